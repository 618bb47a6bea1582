"""Reading XLA's dump of a compile: the buffer assignment's sizes (what `memory_analysis()`
sums, before the compile has finished) and its largest temporaries with the operation and
source line behind each; and the detached compile, whose report is read from the dump while
code generation goes on in the background."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

_detached: list[tuple[threading.Thread, str]] = []
# What the report reads from the dump: the buffer assignment, and the optimized HLO that
# names the temporaries' operations.
_ASSIGNMENT = "*after_optimizations-buffer-assignment.txt"
_OPTIMIZED_HLO = "*after_optimizations.txt"
_STALE_DUMP_S = 3600  # a detached compile writes on after its process exits; swept later


def _sweep_stale_dumps() -> None:
    """Remove dump directories that detached compiles of earlier gate runs left behind."""
    cutoff = time.time() - _STALE_DUMP_S
    for d in glob.glob(os.path.join(tempfile.gettempdir(), "pdecomp-gate-*")):
        with contextlib.suppress(OSError):
            if os.path.getmtime(d) < cutoff:
                shutil.rmtree(d, ignore_errors=True)


def _open_files() -> set[str] | None:
    """Paths this process holds open (Linux), or None where /proc cannot say."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    out = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def _dumped(dump: Path) -> bool:
    """The buffer assignment and optimized HLO are on disk whole: present, not empty, and no
    longer open for writing. XLA 0.10 wrote its dump files one after another, 0.11 creates them
    together and fills them in other threads, so neither the presence of a file nor the order
    of files says that another is complete. Where /proc does not say which files are open,
    the answer is no, and the gate waits for the whole compile (slower, never wrong)."""
    files = [p for pattern in (_ASSIGNMENT, _OPTIMIZED_HLO) for p in dump.glob(pattern)]
    if len(files) < 2 or any(p.stat().st_size == 0 for p in files):
        return False
    held = _open_files()
    return held is not None and not any(str(p.resolve()) in held for p in files)


@contextlib.contextmanager
def persistent_cache_off() -> Any:
    """JAX's persistent compilation cache off for the compiles started inside. A cache hit
    hands back a stored executable without compiling, so XLA writes no buffer assignment: a
    gate that reads one (a detached gate's figures, the largest temporaries) compiles
    afresh. JAX decides once per process whether the cache is used; the documented reset
    makes it decide again. Without a cache directory this does nothing."""
    from jax.experimental.compilation_cache import compilation_cache

    if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        # A detached compile still running took its (absent) cache key when it started.
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def compile_detached(lowered, expected_argument: int | None
                      ) -> tuple[Any, dict[str, int] | None, Path]:
    """Compile in a daemon thread with a dump; return as soon as the buffer assignment is on
    disk: (None, sizes, dump). A compile that ends first returns (executable, None, dump),
    and so does one whose dump does not read as expected: no assignment file, or argument
    bytes that differ from `expected_argument` (the state, target and batch per device, known
    from their shapes): then this waits for the whole compile and its `memory_analysis()`.
    A change in XLA's dump format makes the gate slower, never wrong."""
    _sweep_stale_dumps()
    dump = tempfile.mkdtemp(prefix="pdecomp-gate-")
    result: dict[str, Any] = {}

    def work():
        try:
            result["compiled"] = lowered.compile({"xla_dump_to": dump})
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e

    thread = threading.Thread(target=work, name="pdecomp-gate-compile", daemon=True)
    thread.start()
    _detached.append((thread, dump))
    while thread.is_alive() and not _dumped(Path(dump)):
        time.sleep(0.1)
    if "error" in result:
        raise result["error"]
    assignment = sorted(Path(dump).glob(_ASSIGNMENT))
    sizes = assignment_sizes(assignment[-1]) if assignment and _dumped(Path(dump)) else None
    if thread.is_alive() and sizes is not None and expected_argument in (None,
                                                                         sizes["argument"]):
        return None, sizes, Path(dump)
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["compiled"], None, Path(dump)


def assignment_sizes(path: Path) -> dict[str, int]:
    """What `memory_analysis()` sums over the buffer allocations (XLA's
    CompiledMemoryStats::PopulateBufferStatsFromAllocations), read from the dump: argument =
    entry parameters, output = maybe-live-out, alias = parameters that are live out (donated),
    temp = the rest but thread-local and constant ones."""
    sizes: dict[str, int | None] = dict.fromkeys(("argument", "output", "temp", "alias",
                                                  "host_temp", "host_argument"), 0)
    sizes["xla_peak"] = None  # XLA's own peak exists only once the compile has finished
    for line in path.read_text().splitlines():
        if not (m := _ALLOCATION.match(line)):
            continue
        size, kind = int(m.group(1)), m.group(2)
        param = re.match(r"parameter \d+", kind) is not None
        live_out = "maybe-live-out" in kind
        if param:
            sizes["argument"] += size
            sizes["alias"] += size if live_out else 0
        if live_out:
            sizes["output"] += size
        if not (param or live_out or "thread-local" in kind or kind.startswith("constant")):
            sizes["temp"] += size
    return sizes


def optimized_text(dump_dir: Path) -> str | None:
    """The optimized, partitioned module XLA dumped (its last one), as text."""
    hlo = sorted(dump_dir.glob(_OPTIMIZED_HLO))
    return hlo[-1].read_text() if hlo else None


def compile_in_flight() -> bool:
    return any(t.is_alive() for t, _ in _detached)


def end_process(code: int) -> None:
    """Exit now, leaving a detached compile behind: a normal interpreter exit would tear XLA
    down under the compiling thread (SIGSEGV)."""
    for _, dump in _detached:
        shutil.rmtree(dump, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


# -- XLA's buffer assignment: which operations the temporaries belong to --------------------

# jaxlib 0.11 writes "page N, " before the kind; 0.10 does not.
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (?:page \d+, )?(.*):$")
_VALUE = re.compile(r"^ value: <\d+ ([^ ]+) @[^>]*> \(size=(\d+),offset=\d+\): (.+)$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([^ ]+) = .*?metadata=\{([^}]*)\}")
_TABLE_ROW = re.compile(r"^(\d+) (.+)$")


def largest_temps(dump_dir: Path, n: int) -> list[dict[str, Any]]:
    """The `n` largest values living in temporary allocations, with the operation (JAX's
    op_name) and the innermost source line that made them, from an XLA dump directory."""
    assignment = sorted(dump_dir.glob(_ASSIGNMENT))
    hlo = sorted(dump_dir.glob(_OPTIMIZED_HLO))
    if not assignment or not hlo:
        return []
    values: dict[str, tuple[int, str]] = {}
    in_temp = False
    for line in assignment[-1].read_text().splitlines():
        if m := _ALLOCATION.match(line):
            kind = m.group(2)
            in_temp = not any(k in kind for k in ("parameter", "output", "constant",
                                                  "thread-local"))
        elif in_temp and (m := _VALUE.match(line)):
            name, size, shape = m.group(1), int(m.group(2)), m.group(3).split("{")[0]
            if size > values.get(name, (0, ""))[0]:
                values[name] = (size, shape)
    metadata, locate = _hlo_metadata(hlo[-1].read_text())
    out = []
    for name, (size, shape) in sorted(values.items(), key=lambda kv: -kv[1][0]):
        meta = metadata.get(name, "")
        op = re.search(r'op_name="([^"]*)"', meta)
        if not op and any(o["bytes"] == size and o["shape"] == shape for o in out):
            continue  # a second output of a fusion already listed, with no op of its own
        if len(out) == n:
            break
        frame = re.search(r"stack_frame_id=(\d+)", meta)
        src = re.search(r'source_file="([^"]*)" source_line=(\d+)', meta)
        source = (f"{_short(src.group(1))}:{src.group(2)}" if src
                  else locate(int(frame.group(1))) if frame else "")
        out.append({"bytes": size, "shape": shape, "instruction": name,
                    "op": op.group(1) if op else "", "source": source})
    return out


def _hlo_metadata(text: str) -> tuple[dict[str, str], Callable[[int], str]]:
    """Each instruction's metadata, and a resolver from stack frame id to `file:line (fn)`."""
    tables: dict[str, dict[int, str]] = {}
    section = None
    metadata: dict[str, str] = {}
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
        elif section and (m := _TABLE_ROW.match(line)):
            tables[section][int(m.group(1))] = m.group(2)
        elif not line.strip():
            section = None
        elif m := _INSTRUCTION.match(line):
            metadata[m.group(1)] = m.group(2)

    def field(row: str, key: str) -> int:
        m = re.search(rf"{key}=(\d+)", row)
        return int(m.group(1)) if m else -1

    def locate(frame_id: int) -> str:
        frame = tables.get("StackFrames", {}).get(frame_id, "")
        loc = tables.get("FileLocations", {}).get(field(frame, "file_location_id"), "")
        file = tables.get("FileNames", {}).get(field(loc, "file_name_id"), "").strip('"')
        fn = tables.get("FunctionNames", {}).get(field(loc, "function_name_id"), "").strip('"')
        return f"{_short(file)}:{field(loc, 'line')} ({fn})" if file else ""

    return metadata, locate


def _short(path: str) -> str:
    """A source path from the package root on (`pdecomp/spd/ci.py`), else its last two parts."""
    parts = Path(path).parts
    for root in ("pdecomp", "launcher"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root) - 1:])
    return "/".join(parts[-2:])

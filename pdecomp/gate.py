"""The AOT memory gate: compile the real train step on abstract inputs, read its memory.

Nothing is allocated: the step is lowered on ShapeDtypeStructs carrying their shardings,
and the compiled executable is what training then runs (no second compile).
Peak per device = temp + argument + output − alias (docs/memory_gate.md).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
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
import jaxlib

from pdecomp import hardware
from pdecomp.units import GiB, fmt_bytes


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) for every array leaf of `tree`."""

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


def device_cap_bytes(device: jax.Device, hbm_cap_gib: float, safety_fraction: float,
                     usable: hardware.UsableMemory) -> tuple[int, str]:
    """The per-device cap: the user's `memory.hbm_cap_gib`; on a GPU, the pool its allocator
    was given (card x the usable fraction: the gate caps at what the job may use), or with
    no pool the card's memory x that fraction; elsewhere the device's own limit (host RAM on
    CPU) x the safety fraction, which leaves room for what the compiler's figures miss
    (allocator fragmentation, collective buffers, the runtime itself)."""
    if hbm_cap_gib > 0:
        return int(hbm_cap_gib * GiB), "memory.hbm_cap_gib"
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if device.platform == "gpu":
        card = hardware.card_bytes(device.device_kind)
        if limit and usable.pooled:
            return int(limit), "gpu allocator's pool (bytes_limit)"
        if card or limit:
            return (int((card or limit) * usable.fraction),
                    f"{device.device_kind} {fmt_bytes(card or limit)} x {usable.fraction}")
    source = f"{device.platform} bytes_limit"
    if not limit:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        source = "host RAM"
    return int(limit * safety_fraction), f"{source} x {safety_fraction}"


def compile_and_report(fn: Callable, args: tuple, *, donate_argnums: tuple[int, ...] = (),
                       out_shardings: Any = None, cap_bytes: int, cap_source: str, target: str,
                       mesh: dict[str, int], parts: dict[str, int] | None = None,
                       top_temps: int = 0, detach: bool = False) -> tuple[Any, dict[str, Any]]:
    """Lower and compile `fn` on abstract `args`; return the executable and the gate report.

    `out_shardings` pins the state's layout to its input layout, so the executable can be fed
    its own output step after step. With `top_temps`, XLA dumps its buffer assignment while
    compiling (the executable is the same) and the largest temporaries go into the report.

    With `detach` (a gate-only run whose front end ends the process with `end_process`), the
    report is read from XLA's buffer assignment as soon as XLA writes it, and code generation
    (LLVM, ptxas: about half the compile of a large step) is left running in the background:
    the executable is None and there is no `xla_peak_bytes` (None). The sizes are those
    `memory_analysis()` reports (the same allocations, summed the same way); `parts`, the
    argument bytes per device, checks the reading (see `_compile_detached`).
    """
    t0 = time.perf_counter()
    traced = jax.jit(fn, donate_argnums=donate_argnums,
                     out_shardings=out_shardings).trace(*abstract(args))
    lowered = traced.lower()
    # XLA's cost analysis takes the 8B preset's gate 6 s on the host's CPU backend: a
    # detached gate, there for its memory figures in the shortest time, goes without.
    flops = None if detach else program_flops(lowered)
    mm_flops = matmul_flops(traced.jaxpr)
    if detach:
        with _persistent_cache_off():
            compiled, sizes, dump = _compile_detached(
                lowered, sum(parts.values()) if parts else None)
        compile_s = time.perf_counter() - t0
        temps = largest_temps(dump, top_temps) if top_temps else []
    else:
        dump_dir = tempfile.TemporaryDirectory(prefix="pdecomp-gate-") if top_temps else None
        with dump_dir or contextlib.nullcontext(), \
                _persistent_cache_off() if dump_dir else contextlib.nullcontext():
            compiled = lowered.compile({"xla_dump_to": dump_dir.name} if dump_dir else None)
            compile_s = time.perf_counter() - t0
            temps = largest_temps(Path(dump_dir.name), top_temps) if dump_dir else []
        sizes = None
    sizes = sizes or analysis_sizes(compiled)
    arg, out, temp, alias = (sizes[k] for k in ("argument", "output", "temp", "alias"))
    peak = temp + arg + out - alias
    report = {
        "target": target, "mesh": mesh, "n_devices": math.prod(mesh.values()),
        "argument_bytes": arg, "output_bytes": out, "temp_bytes": temp, "alias_bytes": alias,
        "host_temp_bytes": sizes["host_temp"], "host_argument_bytes": sizes["host_argument"],
        "peak_bytes": peak,
        "xla_peak_bytes": sizes["xla_peak"],
        "cap_bytes": cap_bytes, "cap_source": cap_source, "headroom_bytes": cap_bytes - peak,
        "fits": peak <= cap_bytes, "compile_s": round(compile_s, 3), "flops": flops, "matmul_flops": mm_flops,
        # the figures are XLA's of this jaxlib: another version assigns buffers differently
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "argument_parts_bytes": parts or {},
        "largest_temps": temps,
    }
    return compiled, report


def uncompiled_report(*, argument_bytes: int, cap_bytes: int, cap_source: str, target: str,
                      mesh: dict[str, int], parts: dict[str, int]) -> dict[str, Any]:
    """The report of a step not compiled: its arguments counted from their shapes, a lower
    bound of any compiled peak (peak = temp + argument + output − alias, and alias ≤
    output). Temp and output are unknown, 0 here; `compiled` is False, and the table says
    so. A cap that this bound exceeds is refused without the compile's cost."""
    report = {
        "target": target, "mesh": mesh, "n_devices": math.prod(mesh.values()),
        "argument_bytes": argument_bytes, "output_bytes": 0, "temp_bytes": 0, "alias_bytes": 0,
        "host_temp_bytes": 0, "host_argument_bytes": 0, "peak_bytes": argument_bytes,
        "xla_peak_bytes": None, "cap_bytes": cap_bytes, "cap_source": cap_source,
        "headroom_bytes": cap_bytes - argument_bytes, "fits": argument_bytes <= cap_bytes,
        "compile_s": 0.0, "flops": None, "matmul_flops": None,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "argument_parts_bytes": parts, "largest_temps": [], "compiled": False,
        "note": "not compiled: the peak is the arguments alone, a lower bound",
    }
    return report


def program_flops(lowered: Any) -> float | None:
    """XLA's cost analysis of the lowered step, for the whole mesh (None where it gives none).
    A loop's body counts once, whatever its trip count: compare figures of the same loop
    structure (same microbatch count), or use `matmul_flops`. A deviceless GPU target has
    no backend of its own to analyse with, so the host's CPU backend analyses the same
    (unoptimized, unpartitioned) module. (Run beside the compile in a thread, it made the
    8B preset's gate slower, not faster.)"""
    try:
        cost = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 - an estimate; a backend without one is not an error
        cost = None
    if not cost:
        try:
            from jax._src.lib import _jax  # no public entry point takes another backend
            cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client,
                                                 lowered._lowering.hlo().as_hlo_module())
        except Exception:  # noqa: BLE001 - as above
            return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


def matmul_flops(jaxpr: Any) -> int:
    """Matmul FLOPs of one run of `jaxpr` (a traced step, forward and backward), for the
    whole mesh: 2 x the multiply-adds of every dot_general, a scan's body times its length,
    a rematerialized function's recomputation included (it is in the backward's jaxpr), a
    cond's costliest branch, a while loop's body once. Elementwise work is left out: this is
    the figure MFU is quoted in."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
            lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
            rhs_kept = [d for i, d in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch)]
            total += 2 * math.prod(lhs) * math.prod(rhs_kept)
            continue
        subs = [w for v in eqn.params.values() for w in (v if isinstance(v, tuple | list)
                                                         else (v,))
                if hasattr(w, "eqns") or hasattr(getattr(w, "jaxpr", None), "eqns")]
        if not subs:
            continue
        costs = [matmul_flops(w) for w in subs]
        if name == "cond":
            total += max(costs)
        else:
            total += sum(costs) * (eqn.params["length"] if name == "scan" else 1)
    return total


# A detached compile still generating code, and its dump directory: `end_process` leaves it.
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
def _persistent_cache_off() -> Any:
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


def _compile_detached(lowered, expected_argument: int | None
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


def analysis_sizes(compiled: Any) -> dict[str, int]:
    """The sizes of a finished compile, from XLA's memory analysis."""
    ma = compiled.memory_analysis()
    return {"argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
            "temp": int(ma.temp_size_in_bytes), "alias": int(ma.alias_size_in_bytes),
            "host_temp": int(getattr(ma, "host_temp_size_in_bytes", 0) or 0),
            "host_argument": int(getattr(ma, "host_argument_size_in_bytes", 0) or 0),
            "xla_peak": int(getattr(ma, "peak_memory_in_bytes", 0) or 0)}


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
    """A source path from the package root on (`pdecomp/ci.py`), else its last two parts."""
    parts = Path(path).parts
    for root in ("pdecomp", "launcher"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root) - 1:])
    return "/".join(parts[-2:])


def tree_bytes(tree: Any) -> int:
    """Bytes per device of every array leaf: a sharded leaf counts its shard's shape."""
    total = 0
    for x in jax.tree.leaves(tree):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            sharding = getattr(x, "sharding", None)
            shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
            total += math.prod(shape) * jax.numpy.dtype(x.dtype).itemsize
    return total


def format_report(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows (label, value) for a table; values in MiB/GiB as fits the size."""
    rows = [("target", str(report["target"])),
            ("mesh", " x ".join(f"{k}={v}" for k, v in report["mesh"].items()))]
    if "batch_size" in report:
        rows.append(("batch", str(report["batch_size"])))
    compiled = report.get("compiled", True)
    for k in ("argument", "output", "temp", "alias", "host_temp", "host_argument", "peak",
              "xla_peak"):
        v = report[f"{k}_bytes"]
        if not compiled and k not in ("argument", "peak"):
            value = "n/a (not compiled)"
        elif v is None:
            value = "n/a (read at buffer assignment)"
        else:
            value = fmt_bytes(v) if compiled or k != "peak" else f"at least {fmt_bytes(v)}"
        rows.append((k + (" (temp+arg+out-alias)" if k == "peak" else ""), value))
    for k, v in report.get("argument_parts_bytes", {}).items():
        rows.append((f"  argument: {k}", fmt_bytes(v)))
    rows += [("cap", f"{fmt_bytes(report['cap_bytes'])} ({report['cap_source']})"),
             *([("allocator", report["memory_env"]["note"])]
               if report.get("memory_env", {}).get("note") else []),
             ("headroom", fmt_bytes(report["headroom_bytes"])),
             ("fits", "yes" if report["fits"] else "NO"),
             ("compile", f"{report['compile_s']:.2f} s")]
    if report.get("jaxlib"):
        rows.append(("compiled by", f"jax {report['jax']}, jaxlib {report['jaxlib']}"))
    if report.get("xla_flags"):
        rows.append(("XLA_FLAGS", report["xla_flags"]))
    if report.get("note"):
        rows.append(("note", report["note"]))
    if report.get("matmul_flops"):
        rows.append(("matmul FLOPs / step", f"{report['matmul_flops']:.3e} (whole mesh)"))
    if report.get("flops"):
        rows.append(("XLA FLOPs", f"{report['flops']:.3e} (loop bodies once)"))
    if "fit" in report:
        fit = report["fit"]
        what = "batches" if fit["mode"] == "batch" else "microbatch counts"
        rows.append(("fit", f"{len(fit['tried'])} {what} compiled: {fit['why']}"))
    if "measured_peak_bytes" in report:
        rows.append(("measured peak", fmt_bytes(report["measured_peak_bytes"])))
        rows.append(("predicted / measured", f"{report['predicted_over_measured']:.3f}"))
    return rows


def fit_batch(compile_at: Callable[[int], tuple[Any, dict[str, Any]]], start: int, step: int,
              max_batch: int, floor_at: Callable[[int], dict[str, Any]] | None = None
              ) -> tuple[int, Any, dict[str, Any]]:
    """The largest multiple of `step` (≤ `max_batch`) whose step fits under the cap, found by
    compiling as few candidates as the peak's shape allows (each is a full compile).

    The smallest batch, `step`, is compiled first: if it does not fit, no batch does, and
    the refusal costs one compile. With `floor_at` (a report of a batch made without
    compiling, whose `peak_bytes` is a lower bound of the compiled peak: the argument bytes
    counted from the shapes) a cap that the arguments alone exceed costs none. Then
    `start` (the configured batch) is tried, and after it the batch where the line through
    two compiled points meets the cap: the peak is close to affine in the batch (state and
    target fixed, activations per example). When the lines keep moving the same end of the
    bracket without halving it (a curve bent away from them), one bisection follows, so a
    curve far from a line still closes in. Every candidate is verified by its compile; the
    search ends when
    the largest batch that fits and the smallest that does not are within 1/16 of the batch
    (closer is rarely worth a compile), or at `max_batch`.

    Returns the chosen batch with its executable (None when nothing was compiled) and its
    report, whose `fit` entry lists every batch compiled and says why the choice. A refusal
    returns the smallest batch and its report, which does not fit.
    """
    smallest = f"the smallest batch, {step} (one example per device and microbatch),"
    if floor_at is not None and not (floor := floor_at(step))["fits"]:
        why = (f"the arguments alone of {smallest} take {fmt_bytes(floor['peak_bytes'])} "
               f"> cap {fmt_bytes(floor['cap_bytes'])} per device; nothing compiled")
        return step, None, _with_fit(floor, step, why, {})
    tried: dict[int, tuple[Any, dict[str, Any]]] = {step: compile_at(step)}
    if not tried[step][1]["fits"]:
        first = tried[step][1]
        why = (f"even {smallest} peaks at {fmt_bytes(first['peak_bytes'])} > cap "
               f"{fmt_bytes(first['cap_bytes'])} per device")
        return step, tried[step][0], _with_fit(first, step, why, tried)
    top = max(step, max_batch // step * step)
    lo, hi = step, None
    candidate = min(top, start // step * step)
    bisect, moved, streak = False, None, 0
    while lo < top and (hi is None or hi - lo > _tolerance(lo, step)):
        if not lo < candidate < (top + step if hi is None else hi):
            candidate = (_bisection(lo, hi, step) if bisect
                         else _secant(tried, lo, hi, step, top))
        before = None if hi is None else hi - lo
        tried[candidate] = compile_at(candidate)
        fits = tried[candidate][1]["fits"]
        lo, hi = (candidate, hi) if fits else (lo, candidate)
        # A curve bent away from its lines moves the same end of the bracket again and
        # again by little (the secant's stall): then bisect once.
        streak = streak + 1 if before is not None and moved == fits else 0
        moved = fits if before is not None else None
        bisect = not bisect and streak >= STALL and (hi - lo) * 2 > before
        candidate = 0
    compiled, report = tried[lo]
    why = (f"batch {lo} peaks at {fmt_bytes(report['peak_bytes'])} "
           f"(cap {fmt_bytes(report['cap_bytes'])}); "
           + (f"batch {hi} needs {fmt_bytes(tried[hi][1]['peak_bytes'])}" if hi is not None
              else f"the search stops at gate.fit_max_batch={max_batch}"))
    return lo, compiled, _with_fit(report, lo, why, tried)


# How many times in a row a bracketed step may move the same end again (after the first)
# before a bisection is taken: 2 took the fewest compiles on the test curves (affine,
# superlinear, concave, stepped, sawtooth; tests/test_fit_batch.py).
STALL = 2


def _tolerance(lo: int, step: int) -> int:
    """How close the bracket must close: 1/16 of the batch, in whole steps."""
    return max(step, lo // 16 // step * step)


def _bisection(lo: int, hi: int, step: int) -> int:
    return (lo + hi) // 2 // step * step


def _secant(tried: dict[int, tuple[Any, dict[str, Any]]], lo: int, hi: int | None, step: int,
            top: int) -> int:
    """The next batch to compile: where a line through two compiled peaks meets the cap,
    rounded down to a multiple of `step`, at least a tolerance above `lo` (a candidate that
    then fails closes the bracket) and inside the bracket. The line runs through `lo` and
    the compiled batch nearest it (the most local slope: the curve bends a little), or,
    where that line leaves the bracket, through the bracket's ends; with `lo` alone, through
    zero (with the state's bytes in the peak, that falls short of the answer)."""
    peak = {b: r["peak_bytes"] for b, (_, r) in tried.items()}
    cap = tried[lo][1]["cap_bytes"]

    def meets(other: int) -> float | None:
        slope = (peak[lo] - peak.get(other, 0)) / (lo - other)
        return lo + (cap - peak[lo]) / slope if slope > 0 else None

    near = min((b for b in peak if b != lo), key=lambda b: abs(b - lo), default=0)
    aim = meets(near)
    if hi is not None and (aim is None or not lo < aim < hi):
        aim = meets(hi)
    if aim is None:  # not a line the batch can be read from: double, or bisect the bracket
        aim = 2 * lo if hi is None else (lo + hi) // 2
    ceiling = top if hi is None else hi - step
    return min(ceiling, max(lo + _tolerance(lo, step), int(aim) // step * step))


def _with_fit(report: dict[str, Any], chosen: int, why: str,
              tried: dict[int, tuple[Any, dict[str, Any]]], mode: str = "batch"
              ) -> dict[str, Any]:
    key = {"batch": "batch_size", "microbatches": "microbatches"}[mode]
    report["fit"] = {"mode": mode, "chosen": chosen, "why": why,
                     "tried": [{key: k, "peak_bytes": r["peak_bytes"], "fits": r["fits"]}
                               for k, (_, r) in sorted(tried.items())]}
    return report


def fit_microbatches(compile_at: Callable[[int], tuple[Any, dict[str, Any]]],
                     candidates: list[int]) -> tuple[int, Any, dict[str, Any]]:
    """The fewest microbatches among `candidates` (the counts the batch and the mesh allow)
    whose step fits under the cap. More microbatches never need more memory (each holds
    fewer examples' activations; the state and target are the same), so: the most first
    (if it does not fit, none does: one compile), then the fewest (often enough: two), then
    bisection between the fewest known to fit and the most known not to.

    Returns the count with its executable and report, whose `fit` entry lists every count
    compiled and says why the choice; a refusal returns the most microbatches' report."""
    counts = sorted(set(candidates))
    tried: dict[int, tuple[Any, dict[str, Any]]] = {counts[-1]: compile_at(counts[-1])}
    if not tried[counts[-1]][1]["fits"]:
        most = tried[counts[-1]][1]
        why = (f"even {counts[-1]} microbatches (one example per data-axis device in each) "
               f"peak at {fmt_bytes(most['peak_bytes'])} > cap "
               f"{fmt_bytes(most['cap_bytes'])} per device")
        return counts[-1], tried[counts[-1]][0], _with_fit(most, counts[-1], why, tried,
                                                           "microbatches")
    lo, hi = -1, len(counts) - 1  # counts[lo] does not fit (-1: none tried), counts[hi] fits
    probe = 0
    while hi - lo > 1:
        tried[counts[probe]] = compile_at(counts[probe])
        lo, hi = (lo, probe) if tried[counts[probe]][1]["fits"] else (probe, hi)
        probe = (lo + hi) // 2
    compiled, report = tried[counts[hi]]
    why = (f"{counts[hi]} microbatches peak at {fmt_bytes(report['peak_bytes'])} "
           f"(cap {fmt_bytes(report['cap_bytes'])})"
           + (f"; {counts[lo]} need {fmt_bytes(tried[counts[lo]][1]['peak_bytes'])}"
              if lo >= 0 else "; no fewer are possible"))
    return counts[hi], compiled, _with_fit(report, counts[hi], why, tried, "microbatches")

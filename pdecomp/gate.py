"""The AOT memory gate: compile the real train step on abstract inputs, read its memory.

Nothing is allocated: the step is lowered on ShapeDtypeStructs carrying their shardings,
and the compiled executable is what training then runs (no second compile).
Peak per device = temp + argument + output − alias (docs/MEMORY_GATE.md).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax

GiB = 1024**3


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) for every array leaf of `tree`."""

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


def device_cap_bytes(device: jax.Device, hbm_cap_gib: float, safety_fraction: float
                     ) -> tuple[int, str]:
    """The per-device cap: the user's `memory.hbm_cap_gib`, else the device's own limit
    (host RAM on CPU) times the safety fraction, which leaves room for what the compiler's
    figures miss (allocator fragmentation, collective buffers, the runtime itself)."""
    if hbm_cap_gib > 0:
        return int(hbm_cap_gib * GiB), "memory.hbm_cap_gib"
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    source = f"{device.platform} bytes_limit"
    if not limit:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        source = "host RAM"
    return int(limit * safety_fraction), f"{source} x {safety_fraction}"


def compile_and_report(fn: Callable, args: tuple, *, donate_argnums: tuple[int, ...] = (),
                       cap_bytes: int, cap_source: str, target: str, mesh: dict[str, int],
                       parts: dict[str, int] | None = None) -> tuple[Any, dict[str, Any]]:
    """Lower and compile `fn` on abstract `args`; return the executable and the gate report."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=donate_argnums).lower(*abstract(args)).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    arg = int(ma.argument_size_in_bytes)
    out = int(ma.output_size_in_bytes)
    temp = int(ma.temp_size_in_bytes)
    alias = int(ma.alias_size_in_bytes)
    peak = temp + arg + out - alias
    report = {
        "target": target, "mesh": mesh, "n_devices": math.prod(mesh.values()),
        "argument_bytes": arg, "output_bytes": out, "temp_bytes": temp, "alias_bytes": alias,
        "host_temp_bytes": int(getattr(ma, "host_temp_size_in_bytes", 0) or 0),
        "peak_bytes": peak,
        "xla_peak_bytes": int(getattr(ma, "peak_memory_in_bytes", 0) or 0),
        "cap_bytes": cap_bytes, "cap_source": cap_source, "headroom_bytes": cap_bytes - peak,
        "fits": peak <= cap_bytes, "compile_s": round(compile_s, 3),
        "argument_parts_bytes": parts or {},
    }
    return compiled, report


def tree_bytes(tree: Any, n_shards: int = 1) -> int:
    """Bytes of every array leaf, per device for leaves sharded over `n_shards` devices."""
    total = 0
    for x in jax.tree.leaves(tree):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            total += x.size * jax.numpy.dtype(x.dtype).itemsize
    return total // n_shards


def format_report(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows (label, value) for a table; values in MiB/GiB as fits the size."""

    def size(b: int) -> str:
        return f"{b / GiB:.3f} GiB" if abs(b) >= GiB else f"{b / 1024**2:.3f} MiB"

    rows = [("target", str(report["target"])),
            ("mesh", " x ".join(f"{k}={v}" for k, v in report["mesh"].items()))]
    for k in ("argument", "output", "temp", "alias", "host_temp", "peak", "xla_peak"):
        rows.append((k + (" (temp+arg+out-alias)" if k == "peak" else ""),
                     size(report[f"{k}_bytes"])))
    for k, v in report.get("argument_parts_bytes", {}).items():
        rows.append((f"  argument: {k}", size(v)))
    rows += [("cap", f"{size(report['cap_bytes'])} ({report['cap_source']})"),
             ("headroom", size(report["headroom_bytes"])),
             ("fits", "yes" if report["fits"] else "NO"),
             ("compile", f"{report['compile_s']:.2f} s")]
    if "measured_peak_bytes" in report:
        rows.append(("measured peak", size(report["measured_peak_bytes"])))
        rows.append(("predicted / measured", f"{report['predicted_over_measured']:.3f}"))
    return rows

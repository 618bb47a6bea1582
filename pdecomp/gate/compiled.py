"""The AOT memory gate: compile the real train step on abstract inputs, read its memory.

Nothing is allocated: the step is lowered on ShapeDtypeStructs carrying their shardings,
and the compiled executable is what training then runs (no second compile).
Peak per device = temp + argument + output − alias (docs/memory_gate.md).
"""

from __future__ import annotations

import contextlib
import dataclasses as dc
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib

from pdecomp.core import hardware
from pdecomp.core.units import GiB, fmt_bytes
from pdecomp.gate import dots, forecast, step_cost
from pdecomp.gate.report import GateReport
from pdecomp.gate.xla_dump import (
    compile_detached,
    largest_temps,
    optimized_text,
    persistent_cache_off,
)


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


def target_cap_bytes(target: str, usable: hardware.UsableMemory) -> tuple[int, str]:
    """A deviceless target's cap: the card's memory from the hardware table x the usable
    fraction (the pool a job on it will have)."""
    spec = hardware.GPUS[target]
    return (int(spec.memory_bytes * usable.fraction),
            f"{target} {spec.memory_gib:.1f} GiB x {usable.fraction}")


def compile_and_report(fn: Callable, args: tuple, *, donate_argnums: tuple[int, ...] = (),
                       out_shardings: Any = None, cap_bytes: int, cap_source: str, target: str,
                       mesh: dict[str, int], parts: dict[str, int] | None = None,
                       top_temps: int = 0, detach: bool = False, hosts: int = 1,
                       gpu: hardware.GpuSpec | None = None,
                       basis: forecast.Basis | None = None) -> tuple[Any, GateReport]:
    """Lower and compile `fn` on abstract `args`; return the executable and the gate report.

    `out_shardings` pins the state's layout to its input layout, so the executable can be fed
    its own output step after step. With `top_temps`, XLA dumps its buffer assignment while
    compiling (the executable is the same) and the largest temporaries go into the report.

    With `detach` (a gate-only run whose front end ends the process with `end_process`), the
    report is read from XLA's buffer assignment as soon as XLA writes it, and code generation
    (LLVM, ptxas: about half the compile of a large step) is left running in the background:
    the executable is None and there is no `xla_peak_bytes` (None). The sizes are those
    `memory_analysis()` reports (the same allocations, summed the same way); `parts`, the
    argument bytes per device, checks the reading (see `xla_dump.compile_detached`). With
    a `basis`, the report's step has its forecast.
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
        with persistent_cache_off():
            compiled, sizes, dump = compile_detached(
                lowered, sum(parts.values()) if parts else None)
        compile_s = time.perf_counter() - t0
        temps = largest_temps(dump, top_temps) if top_temps else []
        text = optimized_text(dump) if compiled is None else compiled.as_text()
    else:
        dump_dir = tempfile.TemporaryDirectory(prefix="pdecomp-gate-") if top_temps else None
        with dump_dir or contextlib.nullcontext(), \
                persistent_cache_off() if dump_dir else contextlib.nullcontext():
            compiled = lowered.compile({"xla_dump_to": dump_dir.name} if dump_dir else None)
            compile_s = time.perf_counter() - t0
            temps = largest_temps(Path(dump_dir.name), top_temps) if dump_dir else []
        sizes, text = None, compiled.as_text()
    sizes = sizes or analysis_sizes(compiled)
    arg, out, temp, alias = (sizes[k] for k in ("argument", "output", "temp", "alias"))
    peak = temp + arg + out - alias
    report = GateReport(
        target=target, mesh=mesh, n_devices=math.prod(mesh.values()), argument_bytes=arg,
        output_bytes=out, temp_bytes=temp, alias_bytes=alias,
        host_temp_bytes=sizes["host_temp"], host_argument_bytes=sizes["host_argument"],
        peak_bytes=peak, xla_peak_bytes=sizes["xla_peak"], cap_bytes=cap_bytes,
        cap_source=cap_source, headroom_bytes=cap_bytes - peak, fits=peak <= cap_bytes,
        compile_s=round(compile_s, 3), flops=flops, matmul_flops=mm_flops,
        # the figures are XLA's of this jaxlib: another version assigns buffers differently
        jax=jax.__version__, jaxlib=jaxlib.__version__,
        xla_flags=os.environ.get("XLA_FLAGS", ""), argument_parts_bytes=parts or {},
        largest_temps=temps, step=step_report(text, math.prod(mesh.values()), hosts, gpu,
                                              basis, fresh_bytes=temp + out - alias,
                                              dots_budget_s=dots.GATE_SHARE * compile_s))
    return compiled, report


def step_report(text: str | None, n_devices: int, hosts: int,
                gpu: hardware.GpuSpec | None, basis: forecast.Basis | None = None,
                fresh_bytes: int = 0, dots_budget_s: float = 0.0) -> dict[str, Any] | None:
    """gate.json's `step`: per device FLOPs, HBM bytes and collective bytes by kind; with a
    GPU's rates the roofline time (a floor); with the device's calibration the forecast
    (pdecomp.gate.forecast), on a local device with the step's dots measured for up to
    `dots_budget_s` (pdecomp.gate.dots). None where XLA left no optimized module."""
    if not text:
        return None
    ks = step_cost.kernels(text, n_devices, hosts)
    cost = step_cost.totals(ks)
    out = {**cost, "time": step_cost.roofline(cost, gpu) if gpu else None}
    if basis is not None:  # `fresh_bytes`: what a run allocates anew
        if basis.local:
            basis = dc.replace(basis, calibration=dots.with_dots(basis.calibration, ks,
                                                                 dots_budget_s))
        out["forecast"] = forecast.forecast(ks, basis, fresh_bytes)
    return out


def uncompiled_report(*, argument_bytes: int, cap_bytes: int, cap_source: str, target: str,
                      mesh: dict[str, int], parts: dict[str, int]) -> GateReport:
    """The report of a step not compiled: its arguments counted from their shapes, a lower
    bound of any compiled peak (peak = temp + argument + output − alias, and alias ≤
    output). Temp and output are unknown, 0 here; `compiled` is False, and the table says
    so. A cap that this bound exceeds is refused without the compile's cost."""
    return GateReport(
        target=target, mesh=mesh, n_devices=math.prod(mesh.values()),
        argument_bytes=argument_bytes, output_bytes=0, temp_bytes=0, alias_bytes=0,
        host_temp_bytes=0, host_argument_bytes=0, peak_bytes=argument_bytes,
        xla_peak_bytes=None, cap_bytes=cap_bytes, cap_source=cap_source,
        headroom_bytes=cap_bytes - argument_bytes, fits=argument_bytes <= cap_bytes,
        compile_s=0.0, flops=None, matmul_flops=None, jax=jax.__version__,
        jaxlib=jaxlib.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
        argument_parts_bytes=parts, largest_temps=[], step=None, compiled=False,
        note="not compiled: the peak is the arguments alone, a lower bound")


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
def analysis_sizes(compiled: Any) -> dict[str, int]:
    """The sizes of a finished compile, from XLA's memory analysis."""
    ma = compiled.memory_analysis()
    return {"argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
            "temp": int(ma.temp_size_in_bytes), "alias": int(ma.alias_size_in_bytes),
            "host_temp": int(getattr(ma, "host_temp_size_in_bytes", 0) or 0),
            "host_argument": int(getattr(ma, "host_argument_size_in_bytes", 0) or 0),
            "xla_peak": int(getattr(ma, "peak_memory_in_bytes", 0) or 0)}


def tree_bytes(tree: Any) -> int:
    """Bytes per device of every array leaf: a sharded leaf counts its shard's shape."""
    total = 0
    for x in jax.tree.leaves(tree):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            sharding = getattr(x, "sharding", None)
            shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
            total += math.prod(shape) * jax.numpy.dtype(x.dtype).itemsize
    return total

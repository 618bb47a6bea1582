"""The step's time forecast: XLA's optimized module read kernel by kernel, each at the rate
its device achieves for work of its size (pdecomp.gate.calibration), plus a fixed cost per
kernel; collectives by an alpha-beta model per link.

A kernel is a top-level instruction of the module that does work (a fusion, a dot, a copy,
a collective, a custom call), counted as often as it runs (a loop's body times its trip
count): pdecomp.gate.step_cost.kernels reads them. Each one takes

    launch + max(matmul FLOPs / matmul rate + elementwise ops / op rate, bytes / memory rate)

its matmul rate the one measured for its operands' dtype at its FLOPs (square products),
or, on the device at hand, its own shape's where that was measured slower (a thin product:
pdecomp.gate.dots), its memory rate the one measured for its bytes, its ops
rate for its op count, each transcendental weighted by what its op costs against tanh (a
power: several): a kernel is bound by its compute or by its memory, never both at once. Kernels run one after another (XLA:GPU's stream
does; XLA:CPU may run two independent kernels at once, which its measured rates, taken
with every core busy, already account for). On a CPU, a run's temporaries are allocated
anew and their pages first touched each run, at the measured rate of that
(`fresh_memory`). Collectives are forecast serial with compute (`collectives_overlap` 0:
the peers' measured 8B step overlapped 16% of its gathers).

The floor beside it is the same work at the calibration's best rates with every kernel
free and everything overlapped: no forecast is below it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from pdecomp.gate.calibration import Calibration
from pdecomp.gate.step_cost import Kernel


@dataclass(frozen=True)
class Basis:
    """What a gate forecasts its step with: the device's calibration, the tokens of one
    step (0: its inputs are not tokens), whether each run maps its temporaries anew (a
    CPU process without the launcher's host switches, launcher/host.py), and whether the
    device is the one at hand (its calibration then gains the step's own dots, measured:
    pdecomp.gate.dots)."""

    calibration: Calibration
    tokens_per_step: int = 0
    fresh_temporaries: bool = True
    local: bool = False  # the device at hand: the step's own dots are measured on it


def kernel_seconds(k: Kernel, cal: Calibration) -> dict[str, float]:
    """One run of a kernel, split into where its time goes: launch, matmul, elementwise
    (the compute side), memory, collective."""
    if k.collective and k.link in cal.links:
        return {"launch": 0.0, "collectives": cal.links[k.link].seconds(k.sent_bytes)}
    matmul = (sum(cal.dot_time(sig, k.dtype, f) for sig, f in k.dots) if k.dots
              else k.flops / cal.matmul_rate(k.dtype, k.flops) if k.flops else 0.0)
    ew = (k.ops / cal.elementwise(k.ops) if k.ops else 0.0) + transcendental_seconds(k, cal)
    memory = k.bytes / cal.memory(k.bytes) if k.bytes else 0.0
    if matmul + ew >= memory:
        return {"launch": cal.launch_s, "matmul": matmul, "elementwise": ew}
    return {"launch": cal.launch_s, "memory": memory}


def transcendental_seconds(k: Kernel, cal: Calibration) -> float:
    """A kernel's transcendentals at tanh's rate for their count, each op weighted by its
    measured cost in tanh's (a power is log, multiply and exp: several)."""
    if not k.transcendentals:
        return 0.0
    weighted = sum(n * cal.transcendental_cost.get(op, 1.0)
                   for op, n in k.transcendental_ops or (("tanh", k.transcendentals),))
    return weighted / cal.transcendental(k.transcendentals)


def floor_seconds(ks: list[Kernel], cal: Calibration) -> float:
    """The same work at the calibration's best rates, every kernel free, all overlapped."""
    matmul = sum(k.runs * k.flops / (cal.matmul.get(k.dtype) or cal.matmul["float32"]).peak
                 for k in ks if k.flops and not k.collective)
    memory = sum(k.runs * k.bytes for k in ks if not (k.collective and k.link in cal.links))
    links = defaultdict(float)
    for k in ks:
        if k.collective and k.link in cal.links:
            links[k.link] += k.runs * k.sent_bytes / cal.links[k.link].bandwidth.peak
    return max(matmul, memory / cal.memory.peak, sum(links.values()))


def dots_known(ks: list[Kernel], cal: Calibration) -> dict[str, int]:
    """How many of the step's dot shapes there are and how many were measured (the rest
    at the square products' rate: a gate measures them within its budget, later gates
    the rest)."""
    shapes = {sig for k in ks for sig, _ in k.dots}
    return {"dots": len(shapes), "dots_measured": len(shapes & set(cal.dot_seconds))}


def forecast(ks: list[Kernel], basis: Basis, fresh_bytes: int = 0) -> dict[str, Any]:
    """gate.json's `step.forecast` of a step's kernels (pdecomp.gate.step_cost.kernels):
    seconds per step and their breakdown, the floor, the calibration it read, and tokens/s
    where the step's tokens are known. `fresh_bytes`: what the runtime allocates each run
    (the temporaries and the outputs not aliased), first touched in the step where the
    basis and its calibration say so."""
    cal = basis.calibration
    parts: dict[str, float] = defaultdict(float)
    top: list[tuple[float, str]] = []
    for k in ks:
        each = kernel_seconds(k, cal)
        for part, s in each.items():
            parts[part] += k.runs * s
        top.append((k.runs * sum(each.values()), k.name))
    parts["launch"] += cal.dispatch_s
    fresh = fresh_bytes if basis.fresh_temporaries else 0
    if cal.fresh_bytes_rate and fresh >= cal.fresh_threshold_bytes:
        parts["fresh_memory"] = fresh / cal.fresh_bytes_rate
    total = sum(parts.values())
    top.sort(reverse=True)
    out = {"s_per_step": total, "floor_s": floor_seconds(ks, cal),
           "breakdown_s": {p: parts.get(p, 0.0) for p in
                           ("matmul", "elementwise", "memory", "fresh_memory", "launch",
                            "collectives")},
           "kernels": sum(k.runs for k in ks), "collectives_overlap": 0.0,
           **(dots_known(ks, cal) if basis.local else {}),
           "calibration": {"device": cal.device, "source": cal.source},
           "largest_kernels": [{"name": n, "s": s} for s, n in top[:5]]}
    if basis.tokens_per_step:
        out["tokens_per_s"] = basis.tokens_per_step / total if total else None
    return out

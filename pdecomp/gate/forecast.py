"""The step's time forecast: XLA's optimized module read kernel by kernel, each at the rate
its device achieves for work of its size (pdecomp.gate.calibration), plus a fixed cost per
kernel; collectives by an alpha-beta model per link.

A kernel is a top-level instruction of the module that does work (a fusion, a dot, a copy,
a collective, a custom call), counted as often as it runs (a loop's body times its trip
count, as pdecomp.gate.step_cost counts). Each one takes

    launch + max(matmul FLOPs / matmul rate + elementwise ops / op rate, bytes / memory rate)

its matmul rate the one measured for its operands' dtype at its FLOPs, its memory rate the
one measured for its bytes, its ops rate for its op count: a kernel is bound by its compute
or by its memory, never both at once. Kernels run one after another (XLA:GPU's stream
does; XLA:CPU may run two independent kernels at once, which its measured rates, taken
with every core busy, already account for). On a CPU, a run's temporaries are allocated
anew and their pages first touched each run, at the measured rate of that
(`fresh_memory`). Collectives are forecast serial with compute (`collectives_overlap` 0:
the peers' measured 8B step overlapped 16% of its gathers).

The floor beside it is the same work at the calibration's best rates with every kernel
free and everything overlapped: no forecast is below it.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from pdecomp.gate import step_cost as sc
from pdecomp.gate.calibration import Calibration

# Body instructions that name or move data without computing on it.
NO_OPS = sc.FREE | {"broadcast", "reshape", "slice", "dynamic-slice", "transpose", "copy",
                    "concatenate", "pad", "reverse", "gather", "dynamic-update-slice",
                    "scatter", "dot", "fusion", "custom-call", "iota"}
TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "tanh",
                  "logistic", "sqrt", "rsqrt", "cbrt", "power", "sine", "cosine", "tan",
                  "atan2", "erf", "erf-inv"}


@dataclass(frozen=True)
class Basis:
    """What a gate forecasts its step with: the device's calibration, the tokens of one
    step (0: its inputs are not tokens), and whether each run maps its temporaries anew (a
    CPU process without the launcher's host switches, launcher/host.py)."""

    calibration: Calibration
    tokens_per_step: int = 0
    fresh_temporaries: bool = True


@dataclass(frozen=True)
class Kernel:
    name: str
    runs: int  # times per step
    flops: int  # matmul FLOPs of one run
    dtype: str  # its matmul operands' ("float32", "bfloat16"; "" without a matmul)
    ops: int  # cheap elementwise operations of one run (elements x operations)
    transcendentals: int
    bytes: int  # memory read and written by one run
    collective: str = ""  # its kind, for a collective
    sent_bytes: float = 0.0  # per run, one device's share
    link: str = ""  # "nvlink" within a host, "network" across


def elements(shape: str) -> int:
    """Elements of every array in a shape (a tuple's summed)."""
    return sum(math.prod(int(n) for n in dims.split(",") if n)
               for _, dims in sc._ARRAY.findall(shape))


_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64",
           "f8e4m3fn": "float8", "f8e5m2": "float8"}


def _compute(body: list[Any], shapes: dict[str, str]) -> tuple[int, str, int, int]:
    """(matmul FLOPs, their operands' dtype, cheap ops, transcendentals) of instructions."""
    flops, dtype, ops, trans = 0, "", 0, 0
    for i in body:
        if f := sc.dot_flops(i, shapes):
            flops += f
            lhs = sc.shape_of(i.operands[0], shapes)
            dtype = _DTYPES.get(lhs.split("[")[0], "float32")
        elif i.op == "reduce" or i.op == "reduce-window":
            ops += elements(sc.shape_of(i.operands[0], shapes)) if i.operands else 0
        elif i.op in TRANSCENDENTAL:
            trans += elements(i.shape)
        elif i.op not in NO_OPS:
            ops += elements(i.shape)
    return flops, dtype, ops, trans


def kernels(text: str, n_devices: int, hosts: int = 1) -> list[Kernel]:
    """Every kernel of one step of the module `text`, per device."""
    computations, entry = sc.parse(text)
    runs, inner = sc.multipliers(computations, entry)
    shapes = {i.name: i.shape for c in computations.values() for i in c}
    per_host = max(n_devices // max(hosts, 1), 1)
    out = []
    for name, instructions in computations.items():
        times = runs.get(name, 0)
        if not times or name in inner:
            continue
        for ins in instructions:
            if ins.op in sc.FREE:
                continue
            called = re.search(r"calls=%([\w.\-]+)", ins.attrs) if ins.op == "fusion" else None
            body = computations.get(called.group(1), []) if called else [ins]
            flops, dtype, ops, trans = _compute(body, shapes)
            moved = sc.hbm_bytes(ins, computations, shapes)
            kind, sent, link = sc.COLLECTIVES.get(ins.op, ""), 0.0, ""
            if kind:
                members = sc.group_members(ins.attrs, n_devices)
                if len(members) < 2:
                    kind = ""
                else:
                    sent = sc.sent_bytes(kind, sc._result_bytes(ins, shapes), len(members))
                    link = ("network" if sc._crosses_hosts(ins, members, per_host)
                            else "nvlink")
            out.append(Kernel(ins.name, times, flops, dtype, ops, trans, moved, kind, sent,
                              link))
    return out


def kernel_seconds(k: Kernel, cal: Calibration) -> dict[str, float]:
    """One run of a kernel, split into where its time goes: launch, matmul, elementwise
    (the compute side), memory, collective."""
    if k.collective and k.link in cal.links:
        return {"launch": 0.0, "collectives": cal.links[k.link].seconds(k.sent_bytes)}
    matmul = k.flops / cal.matmul_rate(k.dtype, k.flops) if k.flops else 0.0
    ew = (k.ops / cal.elementwise(k.ops) if k.ops else 0.0) + (
        k.transcendentals / cal.transcendental(k.transcendentals) if k.transcendentals
        else 0.0)
    memory = k.bytes / cal.memory(k.bytes) if k.bytes else 0.0
    if matmul + ew >= memory:
        return {"launch": cal.launch_s, "matmul": matmul, "elementwise": ew}
    return {"launch": cal.launch_s, "memory": memory}


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


def forecast(text: str, n_devices: int, hosts: int, cal: Calibration,
             fresh_bytes: int = 0, tokens_per_step: int | None = None) -> dict[str, Any]:
    """gate.json's `step.forecast`: seconds per step and their breakdown, the floor, the
    calibration it read, and tokens/s where the step's tokens are known. `fresh_bytes`: what
    the runtime allocates each run (the temporaries and the outputs not aliased), first
    touched in the step where the calibration says so."""
    ks = kernels(text, n_devices, hosts)
    parts: dict[str, float] = defaultdict(float)
    top: list[tuple[float, str]] = []
    for k in ks:
        each = kernel_seconds(k, cal)
        for part, s in each.items():
            parts[part] += k.runs * s
        top.append((k.runs * sum(each.values()), k.name))
    parts["launch"] += cal.dispatch_s
    if cal.fresh_bytes_rate and fresh_bytes >= cal.fresh_threshold_bytes:
        parts["fresh_memory"] = fresh_bytes / cal.fresh_bytes_rate
    total = sum(parts.values())
    top.sort(reverse=True)
    out = {"s_per_step": total, "floor_s": floor_seconds(ks, cal),
           "breakdown_s": {p: parts.get(p, 0.0) for p in
                           ("matmul", "elementwise", "memory", "fresh_memory", "launch",
                            "collectives")},
           "kernels": sum(k.runs for k in ks), "collectives_overlap": 0.0,
           "calibration": {"device": cal.device, "source": cal.source},
           "largest_kernels": [{"name": n, "s": s} for s, n in top[:5]]}
    if tokens_per_step:
        out["tokens_per_s"] = tokens_per_step / total if total else None
    return out

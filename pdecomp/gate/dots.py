"""A step's own dots measured on the device at hand, each shape once: a thin product (one
dimension a few elements, or a long contraction into a small result) runs at a fraction of
the rate a square product of its FLOPs reaches, by its shape and its operands' layout, and a
step's are read cold. The measured seconds go into the calibration the gate forecasts with
(`Calibration.dot_seconds`, read by `Calibration.dot_time`), cached per device beside its
calibration (`calibration.dots_cache_path`).

On this 2-core CPU the TMS 5-2 step's thin dots took up to 12x the time square products of
their FLOPs take, SmolLM2's up to 2.8x (bench/RESULTS.md).
"""

from __future__ import annotations

import dataclasses as dc
import json
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
from jax import lax

from pdecomp.core.storage import WriteFailed
from pdecomp.gate import calibration, forecast, microbench
from pdecomp.gate.calibration import Calibration
from pdecomp.gate.step_cost import Kernel, array_bytes

PROBE_FIXED_S = 0.2  # a probe's compile and operands on 2 CPU cores: 0.12-0.29 s measured
GATE_SHARE = 0.1  # of its compile time, what a gate spends measuring the step's dots
PROBE_RUNS, PROBE_BUDGET_S = 3, 0.05  # a probe's timed runs at least, and more within


def probe_cost_s(signature: str, dot_s: float) -> float:
    """About what measuring a dot takes (dot_seconds: a compile, a warm-up run and
    PROBE_RUNS of a chain of `_chain_length` dots, each `dot_s` long, or PROBE_BUDGET_S)."""
    chain_s = _chain_length(signature)[1] * dot_s
    return PROBE_FIXED_S + chain_s + max(PROBE_RUNS * chain_s, PROBE_BUDGET_S)


def _chain_length(signature: str) -> tuple[int, int]:
    """How many copies of a dot's operands make them cold, and the chain's length."""
    lhs, rhs = signature.split(";")[:2]
    copies = max(1, min(16, microbench.COLD_BYTES // max(array_bytes(lhs) + array_bytes(rhs),
                                                           1)))
    return copies, max(copies, 2)


def _operands(signature: str, copies: int) -> tuple[list, list, tuple]:
    """`copies` pairs of a dot's operands (step_cost.dot_signature) and its dimensions."""
    lhs, rhs, _, *dims = signature.split(";")

    def array(spec: str, i: int) -> jax.Array:
        t, shape = spec.rstrip("]").split("[")
        dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16,
                 "f64": jnp.float64}.get(t)
        if dtype is None:
            raise ValueError(f"no probe for a dot on {t}")
        return jnp.full(tuple(int(n) for n in shape.split(",") if n), 1.0 + i / 64, dtype)

    lc, rc, lb, rb = (tuple(int(n) for n in d.split(",") if n) for d in dims)
    return ([array(lhs, i) for i in range(copies)], [array(rhs, i) for i in range(copies)],
            ((lc, rc), (lb, rb)))


def dot_seconds(signature: str, cal: Calibration) -> float:
    """Seconds of one run of a step's dot, measured with its operands cold, as a step's
    are (read long after they were written: its rate from square products, their operands
    in cache, runs a thin product up to three times too fast): a chain of it over copies
    of its operands, microbench.COLD_BYTES of them, each dot waiting on the last one's result (one
    element of it added to its smaller operand). What the chain's other kernels and a
    first touch of its temporaries cost (at `cal`) is taken off."""
    lhs, rhs = signature.split(";")[:2]
    copies, n = _chain_length(signature)
    xs, ys, dims = _operands(signature, copies)
    small = int(array_bytes(rhs) > array_bytes(lhs))

    def run(xs, ys):
        s = jnp.zeros((), jnp.float32)
        for i in range(n):
            pair = [xs[i % copies], ys[i % copies]]
            pair[small] = pair[small] + s.astype(pair[small].dtype)
            s = lax.dot_general(*pair, dims).reshape(-1)[0].astype(jnp.float32) * 1e-30
        return s

    t, ks, temp = microbench.timed(run, (xs, ys), budget_s=PROBE_BUDGET_S,
                                   least=PROBE_RUNS)
    if sum(k.runs for k in ks if k.flops) != n:
        raise ValueError(f"the probe of {signature} compiled to other kernels")
    other = sum(k.runs * sum(forecast.kernel_seconds(k, cal).values())
                for k in ks if not k.flops)
    fresh = temp / cal.fresh_bytes_rate if (cal.fresh_bytes_rate and
                                            temp >= cal.fresh_threshold_bytes) else 0.0
    return max((t - cal.dispatch_s - other - fresh) / n - cal.launch_s, 1e-9)


def with_dots(cal: Calibration, ks: list[Kernel], budget_s: float = 1.0) -> Calibration:
    """`cal` with the seconds of the step's own dots (`dot_seconds`): read from the local
    device's cache, the rest measured now, the dots that take the step longest first, each
    whose probe (`probe_cost_s`) fits in what is left of `budget_s` (those left are forecast
    at the square products' rate), and cached. A dot that cannot be measured is forecast at
    that rate too. The smallest are measured as well: that rate puts TMS 5-2's
    [4096, 5] x [5, 2] at 1 us where it takes 25-100 on this CPU (a row's overhead, not its
    FLOPs), so a share of the step read from it is no reason to leave a dot out."""
    path = calibration.dots_cache_path(cal.device)
    try:
        cached = {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        cached = {}
    weight: dict[str, float] = defaultdict(float)
    once: dict[str, float] = {}
    for k in ks:
        for sig, f in k.dots:
            once[sig] = f / cal.matmul_rate(k.dtype, f)
            weight[sig] += k.runs * once[sig]
    start, new = time.perf_counter(), {}
    for sig in sorted(weight, key=weight.__getitem__, reverse=True):
        left = budget_s - (time.perf_counter() - start)
        if sig in cached or probe_cost_s(sig, once[sig]) > left:
            continue
        try:
            new[sig] = dot_seconds(sig, cal)
        except Exception:  # noqa: BLE001, S112 - a probe that fails leaves the dot to the curve
            continue
    if new:
        try:
            calibration.write_json({**cached, **new}, path)
        except (OSError, WriteFailed):
            pass  # unwritable: the next gate measures them again
    known = {**cached, **new}
    return dc.replace(cal, dot_seconds={s: known[s] for s in weight if s in known})

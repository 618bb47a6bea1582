"""A short microbenchmark of the local device: what its kernels achieve by size, written as
a calibration (pdecomp.gate.calibration) for the gate's forecast.

Each probe is a program of like kernels in a chain (an optimization barrier between two,
so XLA fuses none of them into the next), timed whole (the median of its runs) and read
through the same kernel count the forecast makes of a train step (pdecomp.gate.forecast),
so a probe measures exactly the quantities the forecast multiplies:

- the fixed cost of a kernel: 256 kernels of 16 elements, less one of them, per kernel;
  what one program's dispatch costs beside it;
- matmul FLOP/s at six sizes in float32 and four in bfloat16 (square products);
- memory bytes/s of elementwise kernels (one read, one write) from 256 KiB to 256 MiB, each
  on a buffer of its own, 256 MiB of them a run (cold, as in a step);
- cheap elementwise op-elements/s (32 multiply-adds an element) and transcendentals/s
  (tanh) at three sizes, and what each other transcendental op (exp, log, power...) costs
  an element in tanh's;
- on a CPU, first-touched memory: bytes/s of a run's fresh temporaries;
- with several local GPUs, all-reduce over all of them at four sizes (alpha from the
  smallest, bandwidth by size), as the link within a host.

Every chain keeps its temporaries under FRESH_BYTES, so no probe but the first-touch one
pays for fresh pages: each rate is one quantity.

`pdecomp calibrate [-o FILE]` runs it and prints (or writes) the calibration; a gate runs it
itself the first time it needs the local device's (`local`), and caches what it measured.
"""

from __future__ import annotations

import dataclasses as dc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pdecomp.core.config import ConfigError
from pdecomp.core.storage import WriteFailed
from pdecomp.gate import calibration, forecast
from pdecomp.gate.calibration import Calibration, Curve, Link
from pdecomp.gate.step_cost import Kernel, kernels

R = 8  # kernels in a probe's chain
FRESH_BYTES = 32 * 2**20  # glibc's largest mmap threshold
COLD_BYTES = 256 * 2**20  # more than any host's last-level cache


def _median_s(run: Callable[[], Any], budget_s: float, least: int = 5) -> float:
    """Median seconds of `run()` (waited on): at least `least` runs, more within
    `budget_s`. The median, not the least: a step's kernels sum to its time as their
    typical times do (this host's best runs of a millisecond probe are 10-20% faster than
    its typical ones; a second-long step has no such best runs)."""
    jax.block_until_ready(run())
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or (time.perf_counter() - start < budget_s
                                 and len(times) < 200):
        t = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed(fn: Callable, args: tuple, budget_s: float = 0.15, least: int = 5
           ) -> tuple[float, list[Kernel], int]:
    """Median seconds of one run of compiled `fn`, its kernels as the forecast reads them, and
    its temporary bytes."""
    compiled = jax.jit(fn).lower(*args).compile()
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    return (_median_s(lambda: compiled(*args), budget_s, least),
            kernels(compiled.as_text(), 1), temp)


def chain(step: Callable, n: int) -> Callable:
    """`step` applied n times, each result kept apart from the next by a barrier."""

    def run(x, *rest):
        for _ in range(n):
            x = lax.optimization_barrier(step(x, *rest))
        return x

    return run


@dataclass(frozen=True)
class Probe:
    kernel: Kernel  # one of the chain's kernels, as the forecast reads it
    seconds: float  # what one of them takes beyond its launch


def probe(step: Callable, args: tuple, pick: Callable[[Kernel], bool], launch: float,
          dispatch: float, budget_s: float = 0.15) -> Probe:
    """A chain of kernels of `step`, as many as keep its temporaries under FRESH_BYTES (so
    no page is first touched in a run, which `fresh_rate` measures apart): the seconds of
    one beyond its launch."""
    n = max(2, min(R, FRESH_BYTES // (2 * max(_bytes(args[0]), 1))))
    t, ks, _ = timed(chain(step, n), args, budget_s)
    chosen = sum(k.runs for k in ks if pick(k))
    each = (t - dispatch - sum(k.runs for k in ks) * launch) / max(chosen, 1)
    return Probe(next(k for k in ks if pick(k)), max(each, 1e-9))


def _bytes(x: Any) -> int:
    return x.size * x.dtype.itemsize


def fixed_costs() -> tuple[float, float]:
    """(seconds per kernel, seconds per program dispatch)."""
    x = jnp.ones((16,), jnp.float32)
    one, k1, _ = timed(chain(lambda v: v * 1.0001 + 1e-4, 1), (x,))
    many, k256, _ = timed(chain(lambda v: v * 1.0001 + 1e-4, 256), (x,))
    n1, n256 = sum(k.runs for k in k1), sum(k.runs for k in k256)
    launch = max((many - one) / max(n256 - n1, 1), 1e-8)
    return launch, max(one - n1 * launch, 0.0)


def matmuls(launch: float, dispatch: float, sizes: dict[str, tuple[int, ...]]
            ) -> dict[str, Curve]:
    out = {}
    key = jax.random.PRNGKey(0)
    for dtype, ns in sizes.items():
        points = []
        for n in ns:
            w = (jax.random.normal(key, (n, n)) / n ** 0.5).astype(dtype)
            p = probe(lambda v, m: v @ m, (w, w), lambda k: k.flops > 0, launch, dispatch,
                      budget_s=0.3)
            points.append((float(p.kernel.flops), p.kernel.flops / p.seconds))
        out[dtype] = Curve(tuple(points))
    return out


def memory(launch: float, dispatch: float, sizes_bytes: tuple[int, ...]) -> Curve:
    """Bytes/s of elementwise kernels (one read, one write) by the bytes they move, each on
    a buffer of its own written over in place, COLD_BYTES of them a run: a step's working
    set is larger than the caches, and its kernels mostly read what was written long
    before (on the same buffer again and again, the rate is the cache's: 2-3x)."""
    points = []
    for size in sizes_bytes:
        n = max(COLD_BYTES // size, 4)
        state = [[jnp.full((size // 4,), 1.0 + i, jnp.float32) for i in range(n)]]
        fn = jax.jit(lambda vs: [v * 1.0001 + 1e-4 for v in vs], donate_argnums=0)
        count = sum(k.runs for k in kernels(fn.lower(state[0]).compile().as_text(), 1))

        def run(fn=fn, state=state):  # each run writes over the last one's output
            state[0] = fn(state[0])
            return state[0]

        each = (_median_s(run, 0.0) - dispatch) / count - launch
        points.append((2.0 * size, 2 * size / max(each, 1e-9)))
    return Curve(tuple(points))


def fresh_rate(cal: Calibration, buffer_bytes: int, n: int) -> float:
    """Bytes/s of memory a run allocates and first touches: XLA:CPU allocates a run's
    temporaries anew each run and, above FRESH_BYTES, glibc's malloc maps them anew, so each
    page faults once. The probe is a step's pattern: n kernels, each writing a buffer of its
    own, all live at once; its time beyond its kernels' forecast (at `cal`, measured without
    first touches), per byte of its temporaries."""
    x = jnp.ones((buffer_bytes // 4,), jnp.float32)

    def fn(v):
        ys = lax.optimization_barrier([v * (1.0 + i / n) for i in range(n)])
        return sum(ys[1:], ys[0])

    t, ks, temp = timed(fn, (x,))
    kernels_s = cal.dispatch_s + sum(k.runs * sum(forecast.kernel_seconds(k, cal).values())
                                     for k in ks)
    return temp / (t - kernels_s) if t > kernels_s and temp >= FRESH_BYTES else 0.0


def elementwise(launch: float, dispatch: float, mem: Curve, n_elements: tuple[int, ...],
                transcendental: bool) -> Curve:
    """Op-elements/s of kernels that compute more than they move: 32 multiply-adds an
    element, or 4 tanh."""

    def many_ops(v):
        for _ in range(16):
            v = v * 1.0001 + 1e-4
        return v

    def tanhs(v):
        for _ in range(4):
            v = jnp.tanh(v)
        return v

    points = []
    for n in n_elements:
        x = jnp.full((n,), 0.5, jnp.float32)
        p = probe(tanhs if transcendental else many_ops, (x,), lambda k, n=n: k.bytes >= 8 * n,
                  launch, dispatch)
        count = p.kernel.transcendentals if transcendental else p.kernel.ops
        points.append((float(count), count / p.seconds))
    return Curve(tuple(points))


# Each transcendental op XLA may emit, as a step that keeps its values in range (chained 4
# times in one kernel): what it costs an element against tanh's.
OPS: dict[str, Callable] = {
    "exponential": lambda v: jnp.exp(-v), "log": lambda v: jnp.log(v + 2.0),
    "power": lambda v: v ** (v + 0.5), "logistic": jax.nn.sigmoid,
    "sqrt": lambda v: jnp.sqrt(v + 0.25), "rsqrt": lambda v: lax.rsqrt(v + 1.0),
    "erf": lax.erf, "sine": jnp.sin, "cosine": jnp.cos}


def transcendental_costs(launch: float, dispatch: float, n: int) -> dict[str, float]:
    """Seconds of one element of each op in OPS over tanh's, on n elements."""

    def times4(op: Callable) -> Callable:
        def run(v):
            for _ in range(4):
                v = op(v)
            return v
        return run

    def each(op: Callable) -> float:
        p = probe(times4(op), (jnp.full((n,), 0.5, jnp.float32),),
                  lambda k: k.transcendentals > 0, launch, dispatch, budget_s=0.05)
        return p.seconds / p.kernel.transcendentals

    tanh = each(jnp.tanh)
    return {name: round(each(op) / tanh, 3) for name, op in OPS.items()}


def links(sizes_bytes: tuple[int, ...]) -> dict[str, Link]:
    """The collectives of all local devices (none with one device or on CPU, where the
    forecast counts a collective's bytes as memory traffic)."""
    devices = jax.local_devices()
    if len(devices) < 2 or devices[0].platform == "cpu":
        return {}
    mesh = jax.make_mesh((len(devices),), ("d",))
    spec = jax.sharding.PartitionSpec("d")
    points = []
    for size in sizes_bytes:
        x = jax.device_put(jnp.ones((len(devices), size // 4), jnp.float32),
                           jax.sharding.NamedSharding(mesh, spec))
        fn = jax.shard_map(chain(lambda v: lax.psum(v, "d"), R), mesh=mesh, in_specs=spec,
                           out_specs=spec)
        t, _, _ = timed(fn, (x,))
        sent = 2 * size * (len(devices) - 1) / len(devices)  # a ring all-reduce
        points.append((sent, t / R))
    alpha = points[0][1]
    curve = Curve(tuple((s, s / max(t - alpha, 1e-9)) for s, t in points[1:]))
    return {"nvlink": Link(alpha, curve)}


def measure() -> Calibration:
    """The local device's calibration (a few seconds on a 2-core CPU)."""
    device = jax.local_devices()[0]
    launch, dispatch = fixed_costs()
    big = device.platform != "cpu"
    mm = matmuls(launch, dispatch, {
        "float32": (64, 128, 256, 512, 1024, 2048) + ((4096, 8192) if big else ()),
        "bfloat16": (128, 512, 1024, 2048) + ((4096, 8192) if big else ())})
    mem = memory(launch, dispatch, tuple(2 ** p for p in range(18, 29, 2)))
    sizes = (1 << 14, 1 << 18, 1 << 21) + ((1 << 24,) if big else ())
    cal = Calibration(
        device=device.device_kind, source=f"measured by pdecomp.gate.microbench, jax "
        f"{jax.__version__}, {time.strftime('%Y-%m-%d')}", launch_s=launch,
        dispatch_s=dispatch, matmul=mm, memory=mem,
        elementwise=elementwise(launch, dispatch, mem, sizes, False),
        transcendental=elementwise(launch, dispatch, mem, sizes, True),
        transcendental_cost=transcendental_costs(launch, dispatch, sizes[1]),
        links=links((1 << 12, 1 << 20, 1 << 24, 1 << 27)))
    if device.platform != "cpu":  # a GPU's allocator keeps one pool, taken at start
        return cal
    fresh = [fresh_rate(cal, size, n) for size, n in ((1 << 21, 48), (1 << 23, 16))
             for _ in range(2)]
    return dc.replace(cal, fresh_bytes_rate=statistics.median(fresh))


def local(device_kind: str) -> Calibration:
    """The local device's calibration: PDECOMP_CALIBRATION's file, else the cached
    measurement, else measured now (a few seconds) and cached."""
    if given := os.environ.get(calibration.FILE_VAR):
        return calibration.read(Path(given))
    path = calibration.cache_path(device_kind)
    if path.is_file():
        try:
            return calibration.read(path)
        except ConfigError:
            pass  # a damaged cache is measured again
    cal = measure()
    try:
        calibration.write(cal, path)
    except (OSError, WriteFailed):
        pass  # an unwritable cache costs the next gate a measurement, nothing else
    return cal


def for_target(card: str | None, device_kind: str) -> Calibration | None:
    """The calibration a gate forecasts with: a deviceless card's file, else the local
    device's (measured, cached). None where the local device cannot be measured: the gate
    then reports its floor alone."""
    if card:
        return calibration.for_card(card)
    try:
        return local(device_kind)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - a forecast is never a reason to stop a gate
        return None

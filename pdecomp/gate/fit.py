"""The gate's searches: the largest batch whose step fits under the cap (`gate.fit=batch`),
the fewest microbatches that fit (`gate.fit=microbatches`), each candidate a full compile,
as few of them as the peak's shape allows; and the mesh that fits in the least predicted
time (`gate.fit=mesh`), every candidate compiled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdecomp.core.units import fmt_bytes
from pdecomp.gate.report import GateReport


def fit_batch(compile_at: Callable[[int], tuple[Any, GateReport]], start: int, step: int,
              max_batch: int, floor_at: Callable[[int], GateReport] | None = None
              ) -> tuple[int, Any, GateReport]:
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
    if floor_at is not None and not (floor := floor_at(step)).fits:
        why = (f"the arguments alone of {smallest} take {fmt_bytes(floor.peak_bytes)} "
               f"> cap {fmt_bytes(floor.cap_bytes)} per device; nothing compiled")
        return step, None, _with_fit(floor, step, why, {})
    tried: dict[int, tuple[Any, GateReport]] = {step: compile_at(step)}
    if not tried[step][1].fits:
        first = tried[step][1]
        why = (f"even {smallest} peaks at {fmt_bytes(first.peak_bytes)} > cap "
               f"{fmt_bytes(first.cap_bytes)} per device")
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
        fits = tried[candidate][1].fits
        lo, hi = (candidate, hi) if fits else (lo, candidate)
        # A curve bent away from its lines moves the same end of the bracket again and
        # again by little (the secant's stall): then bisect once.
        streak = streak + 1 if before is not None and moved == fits else 0
        moved = fits if before is not None else None
        bisect = not bisect and streak >= STALL and (hi - lo) * 2 > before
        candidate = 0
    compiled, report = tried[lo]
    why = (f"batch {lo} peaks at {fmt_bytes(report.peak_bytes)} "
           f"(cap {fmt_bytes(report.cap_bytes)}); "
           + (f"batch {hi} needs {fmt_bytes(tried[hi][1].peak_bytes)}" if hi is not None
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


def _secant(tried: dict[int, tuple[Any, GateReport]], lo: int, hi: int | None, step: int,
            top: int) -> int:
    """The next batch to compile: where a line through two compiled peaks meets the cap,
    rounded down to a multiple of `step`, at least a tolerance above `lo` (a candidate that
    then fails closes the bracket) and inside the bracket. The line runs through `lo` and
    the compiled batch nearest it (the most local slope: the curve bends a little), or,
    where that line leaves the bracket, through the bracket's ends; with `lo` alone, through
    zero (with the state's bytes in the peak, that falls short of the answer)."""
    peak = {b: r.peak_bytes for b, (_, r) in tried.items()}
    cap = tried[lo][1].cap_bytes

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


def _with_fit(report: GateReport, chosen: int, why: str,
              tried: dict[int, tuple[Any, GateReport]], mode: str = "batch"
              ) -> GateReport:
    key = {"batch": "batch_size", "microbatches": "microbatches", "mesh": "model"}[mode]

    def row(k: int, r: GateReport) -> dict[str, Any]:
        out = {key: k, "peak_bytes": r.peak_bytes, "fits": r.fits}
        if mode == "mesh":
            out.update(mesh=r.mesh, step_s=_seconds(r), floor_s=r.step["time"]["roofline_s"],
                       bound=r.step["time"]["bound"])
        return out

    report.fit = {"mode": mode, "chosen": chosen, "why": why,
                     "tried": [row(k, r) for k, (_, r) in sorted(tried.items())]}
    return report


def _seconds(report: GateReport) -> float:
    """The step's forecast (pdecomp.gate.forecast), or its floor where none was made."""
    if f := report.step.get("forecast"):
        return f["s_per_step"]
    return report.step["time"]["roofline_s"]


def fit_mesh(compile_at: Callable[[int], tuple[Any, GateReport]], models: list[int]
             ) -> tuple[int, Any, GateReport]:
    """The model-axis size among `models` (the other devices on the data axis) whose step
    fits under the cap in the least time forecast from its compiled module
    (`step.forecast`, at the target's calibration; its floor `step.time` where there is
    none). Every candidate is compiled: the peak and the time both move with the split,
    neither monotonically.

    Returns the size with its executable and report, whose `fit` entry lists every split
    with its peak, forecast and floor; a refusal returns the split of the least peak."""
    tried = {m: compile_at(m) for m in sorted(set(models))}
    fitting = [m for m, (_, r) in tried.items() if r.fits]
    if fitting:
        chosen = min(fitting, key=lambda m: _seconds(tried[m][1]))
        report = tried[chosen][1]
        why = (f"forecast {_seconds(report):.3g} s a step "
               f"({report.step['time']['bound']}-bound), peak "
               f"{fmt_bytes(report.peak_bytes)} (cap {fmt_bytes(report.cap_bytes)}); "
               f"{len(fitting)} of {len(tried)} splits fit")
    else:
        chosen = min(tried, key=lambda m: tried[m][1].peak_bytes)
        report = tried[chosen][1]
        why = (f"none of {len(tried)} splits fits: the least peak, "
               f"{fmt_bytes(report.peak_bytes)} at {report.mesh}, > cap "
               f"{fmt_bytes(report.cap_bytes)} per device")
    return chosen, tried[chosen][0], _with_fit(report, chosen, why, tried, "mesh")


def fit_microbatches(compile_at: Callable[[int], tuple[Any, GateReport]],
                     candidates: list[int]) -> tuple[int, Any, GateReport]:
    """The fewest microbatches among `candidates` (the counts the batch and the mesh allow)
    whose step fits under the cap. More microbatches never need more memory (each holds
    fewer examples' activations; the state and target are the same), so: the most first
    (if it does not fit, none does: one compile), then the fewest (often enough: two), then
    bisection between the fewest known to fit and the most known not to.

    Returns the count with its executable and report, whose `fit` entry lists every count
    compiled and says why the choice; a refusal returns the most microbatches' report."""
    counts = sorted(set(candidates))
    tried: dict[int, tuple[Any, GateReport]] = {counts[-1]: compile_at(counts[-1])}
    if not tried[counts[-1]][1].fits:
        most = tried[counts[-1]][1]
        why = (f"even {counts[-1]} microbatches (one example per data-axis device in each) "
               f"peak at {fmt_bytes(most.peak_bytes)} > cap "
               f"{fmt_bytes(most.cap_bytes)} per device")
        return counts[-1], tried[counts[-1]][0], _with_fit(most, counts[-1], why, tried,
                                                           "microbatches")
    lo, hi = -1, len(counts) - 1  # counts[lo] does not fit (-1: none tried), counts[hi] fits
    probe = 0
    while hi - lo > 1:
        tried[counts[probe]] = compile_at(counts[probe])
        lo, hi = (lo, probe) if tried[counts[probe]][1].fits else (probe, hi)
        probe = (lo + hi) // 2
    compiled, report = tried[counts[hi]]
    why = (f"{counts[hi]} microbatches peak at {fmt_bytes(report.peak_bytes)} "
           f"(cap {fmt_bytes(report.cap_bytes)})"
           + (f"; {counts[lo]} need {fmt_bytes(tried[counts[lo]][1].peak_bytes)}"
              if lo >= 0 else "; no fewer are possible"))
    return counts[hi], compiled, _with_fit(report, counts[hi], why, tried, "microbatches")

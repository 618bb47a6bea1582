"""Each kernel of a run's step, its forecast beside its time in the step: where a forecast of
the whole step (pdecomp.gate.forecast) misses, kernel by kernel. The step is gated and made
ready as bench/time_step.py does (a `pdecomp` job's process, or `--library`), with a
calibration measured in this process and every dot of the step, then profiled
(jax.profiler) for STEPS steps.

    .venv/bin/python bench/kernel_times.py [--library] [--top N] [--job NAME] [--packed FILE]
        STEPS [OVERRIDES...]

`--job NAME`: a job of bench/bench_time_model.py (CPU_JOBS or the GPU jobs) with its
overrides, OVERRIDES after them. A kernel's time is read from the profile's events that carry
its name: on a GPU the device's (each kernel's HLO op), on a CPU XLA's thunks, two
independent ones of which may run at once on its cores (so the kernels' times may sum past
the step's: `busy_s` is their union). Prints one JSON line: the steps' seconds under the
profiler, the forecast and measured seconds of the dots and of the other kernels and by
kind of kernel (`kinds`), the N kernels the step spends longest in, forecast or measured,
and every kernel's measured seconds. `--packed FILE`: FILE an earlier run's output, made on
one core (`taskset -c 0`); its kernels' seconds packed on this process's cores
(bench/packing.py) beside this run's step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
import packing
from bench_time_model import CPU_JOBS, jobs
from time_step import ready

from pdecomp.gate import calibration, dots, forecast, microbench, step_cost


def events(trace_dir: Path) -> list[tuple[str, int, int]]:
    """(op name, start ns, end ns) of every event in the profile: the device planes' where
    there are any (a GPU's kernels, their HLO op a stat of each), else the host's."""
    from jax.profiler import ProfileData

    path = next(trace_dir.rglob("*.xplane.pb"))
    planes = list(ProfileData.from_file(str(path)).planes)
    device = [p for p in planes if p.name.startswith("/device:")]
    out = []
    for plane in device or planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                name = str(stats.get("hlo_op") or e.name)
                out.append((name, e.start_ns, e.end_ns))
    return out


def union_s(spans: list[tuple[int, int]]) -> float:
    """Seconds covered by at least one of the spans (ns)."""
    total, end = 0, -1
    for s, e in sorted(spans):
        total += e - max(s, end) if e > end else 0
        end = max(end, e)
    return total / 1e9


def row_width(shape: str) -> int:
    """The minor dimension of a kernel's (first) result, by its layout: the length of the
    rows its loop runs over (0 for a scalar)."""
    m = re.search(r"\[([\d,]*)\](?:\{([\d,]*)\})?", shape)
    dims = [int(d) for d in m.group(1).split(",") if d] if m else []
    if not dims:
        return 0
    minor = int(m.group(2).split(",")[0]) if m.group(2) else len(dims) - 1
    return dims[minor]


def kinds(text: str) -> dict[str, str]:
    """Each top-level kernel's kind: a matmul, a custom (YNNPACK) fusion without one, or
    a loop over rows narrower than a 16-lane vector's two, or wider."""
    computations, _ = step_cost.parse(text)
    shapes = {i.name: i.shape for c in computations.values() for i in c}
    out = {}
    for ins in (i for c in computations.values() for i in c):
        out[ins.name] = ("matmul" if step_cost.dot_flops(ins, shapes) else
                         "custom fusion" if "kind=kCustom" in ins.attrs else
                         "rows < 32 wide" if row_width(ins.shape) < 32 else "rows >= 32 wide")
    return out


def by_kind(rows: list[dict], kind: dict[str, str]) -> dict[str, dict[str, float]]:
    """Forecast and measured seconds a step, summed by kind of kernel (`kinds`)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        k = out.setdefault("matmul" if r["dot"] else kind.get(r["name"], "other"),
                           {"kernels": 0, "forecast_s": 0.0, "measured_s": 0.0})
        k["kernels"] += r["runs"]
        k["forecast_s"] += r["forecast_s"]
        k["measured_s"] += r["measured_s"]
    return out


def compare(ks: list[step_cost.Kernel], cal, evs: list[tuple[str, int, int]], steps: int,
            top: int, kind: dict[str, str]) -> dict:
    """Each kernel's forecast (its runs at `cal`) beside its measured seconds a step."""
    by_name = {k.name: k for k in ks} | {k.name.replace(".", "_"): k for k in ks}
    measured: dict[str, float] = defaultdict(float)
    spans = []
    for name, s, e in evs:
        if (k := by_name.get(name)) is not None:
            measured[k.name] += (e - s) / 1e9 / steps
            spans.append((s, e))
    rows = [{"name": k.name, "dot": bool(k.dots or k.flops), "runs": k.runs,
             "forecast_s": k.runs * sum(forecast.kernel_seconds(k, cal).values()),
             "measured_s": measured.get(k.name, 0.0),
             "dots": [sig for sig, _ in k.dots][:2]} for k in ks]
    sums = {f"{part}_{kind}_s": sum(r[f"{kind}_s"] for r in rows if r["dot"] == is_dot)
            for part, is_dot in (("dots", True), ("other", False))
            for kind in ("forecast", "measured")}
    rows.sort(key=lambda r: -max(r["forecast_s"], r["measured_s"]))
    return {**sums, "busy_s": union_s(spans) / steps,
            "kernels_seen": len(measured), "kernels": len(ks), "by_kind": by_kind(rows, kind),
            "top": rows[:top],
            "per_kernel_s": {n: round(s, 9) for n, s in sorted(measured.items())}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--library", action="store_true", help="a library caller's process")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--job", help="a job of bench/bench_time_model.py, its overrides first")
    p.add_argument("--packed", metavar="FILE",
                   help="an earlier run's output (on one core: taskset -c 0): its kernels' "
                        "times packed on this process's cores (bench/packing.py)")
    p.add_argument("steps", type=int)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    known = {**{k: v[1] for k, v in CPU_JOBS.items()},
             **{k: v[2] for k, v in jobs(None, None).items()}}
    if a.job and a.job not in known:
        p.error(f"--job: one of {', '.join(sorted(known))}")
    overrides = [*(known[a.job] if a.job else []), *a.overrides]
    with tempfile.TemporaryDirectory() as d:
        os.environ[calibration.DIR_VAR] = str(Path(d) / "calibration")  # this spell's own
        g, f, state, target, batches = ready(overrides, a.steps, Path(d), not a.library, True)
        ks = step_cost.kernels(g.compiled.as_text(), 1, 1)
        cal = dots.with_dots(microbench.local(jax.devices()[0].device_kind), ks, 600.0)
        seconds = []
        with jax.profiler.trace(str(Path(d) / "trace")):
            for b in batches:
                t = time.perf_counter()
                state, m = g.compiled(state, target, b)
                jax.block_until_ready((state, m))
                seconds.append(time.perf_counter() - t)
        out = compare(ks, cal, events(Path(d) / "trace"), a.steps, a.top,
                      kinds(g.compiled.as_text()))
        if a.packed:
            one_core = json.loads(Path(a.packed).read_text().strip().splitlines()[-1])
            cores = len(os.sched_getaffinity(0))
            out["packed"] = {"cores": cores, "from": a.packed, "s": packing.packed_s(
                g.compiled.as_text(), one_core["per_kernel_s"], cores)}
    print(json.dumps({"overrides": overrides, "seconds": seconds,
                      "forecast_s": f["s_per_step"], "breakdown_s": f["breakdown_s"], **out}))


if __name__ == "__main__":
    main()

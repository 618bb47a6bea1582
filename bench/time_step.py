"""One run's train step on this machine: gated as `pdecomp` gates it (its forecast made from
this device's calibration), then the very executable timed, nothing else in the loop.

    .venv/bin/python bench/time_step.py [--library] [--calibrate] STEPS [OVERRIDES...]

By default the process is a `pdecomp` job's: the launcher's host switches (launcher/host.py:
programs run inline, freed blocks kept, so a CPU step reuses its temporaries) and the gate
told so. `--library`: a library caller's process, left as it is (each CPU step maps its
temporaries anew). `--calibrate`: this process measures its calibration (no cache), its gate
makes the forecast from it, with every dot of the step measured (a gate measures them for a
second at most; later gates the rest), and the steps are timed in BLOCKS blocks, the
calibration measured again, dots included, after each: each block is compared with the mean
of the forecasts either side of it, so calibration and step share one spell of a host whose
speed drifts by up to 2x over minutes.

Give a block about a calibration's time (10-25 s), so both see the same spell of the host.
Prints one JSON line: the median and every step's seconds (three warm-up steps first, on
DRAWN batches drawn before timing, taken in turn), the gate's forecast and floor, minor page faults a step.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

from launcher import api, host
from pdecomp.gate import calibration, forecast, microbench
from pdecomp.gate.compiled import step_report
from pdecomp.gate.shapes import load_target
from pdecomp.gate.step import Gated, gate
from pdecomp.run.checkpoint import Checkpointer
from pdecomp.run.decompose import prepare
from pdecomp.run.loop import initial_state

WARMUP = 3
BLOCKS = 3  # with --calibrate: blocks of steps, the calibration measured after each
DRAWN = 32  # batches drawn before timing, taken in turn


def forecast_with(cal: calibration.Calibration, g: Gated, job: bool) -> dict:
    """The gated step's forecast with calibration `cal`, every dot of it measured that
    counts (as a gate's with no limit on its time)."""
    basis = forecast.Basis(cal, fresh_temporaries=not job, local=True)
    return step_report(g.compiled.as_text(), 1, 1, None, basis, g.report.fresh_bytes,
                       dots_budget_s=600.0)["forecast"]


def ready(overrides: list[str], steps: int, work: Path, job: bool, calibrate: bool
          ) -> tuple[Gated, dict, object, object, list]:
    """The run gated (its forecast, every dot measured where `calibrate`), its state and
    target, warmed up, and its steps' batches, drawn."""
    if job:
        host.run_programs_inline()  # before JAX starts its backend, as launcher/job.py
    run = prepare(api.compose(["logging.wandb.mode=disabled", *overrides]))
    g = gate(run, work, False, lambda _: None, temporaries_reused=job)
    f = g.report.step["forecast"]
    if calibrate:  # the gate measured this process's calibration; now every dot of the step
        f = forecast_with(microbench.local(jax.devices()[0].device_kind), g, job)
    target, _ = load_target(g.run, g.target_abs, lambda _: None)
    if job:
        host.keep_freed_blocks_on_cpu()
    state, _ = initial_state(g, target, Checkpointer(work / "ck", writer=True), lambda _: None)
    c = g.run.config
    sample = g.run.kind.batch_sampler(c.model, c.data, c.seed, g.batch_sharding, g.data_key)
    drawn = [sample(i) for i in range(WARMUP + min(steps, DRAWN))]
    jax.block_until_ready(drawn)
    state, _ = _steps(g, state, target, drawn[:WARMUP])
    n = len(drawn) - WARMUP
    return g, f, state, target, [drawn[WARMUP + i % n] for i in range(steps)]


def timed(overrides: list[str], steps: int, work: Path, job: bool, calibrate: bool) -> dict:
    g, f, state, target, batches = ready(overrides, steps, work, job, calibrate)
    seconds, forecasts, blocks = [], [f], []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i, block in enumerate(_blocks(batches, BLOCKS if calibrate else 1)):
        state, times = _steps(g, state, target, block)
        seconds += times
        blocks.append(statistics.median(times))
        if calibrate:  # measured again, dots too: a cache of its own, empty
            faults -= resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            os.environ[calibration.DIR_VAR] = str(work / f"calibration_{i + 1}")
            forecasts.append(forecast_with(microbench.measure(), g, job))
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    beside = [(forecasts[i]["s_per_step"] + forecasts[i + 1]["s_per_step"]) / 2
              if calibrate else f["s_per_step"] for i in range(len(blocks))]
    return {"measured_s": statistics.median(seconds), "seconds": seconds,
            "forecast": f, "forecasts_s": [x["s_per_step"] for x in forecasts],
            "blocks_s": blocks, "block_errors": [b / m - 1 for b, m in zip(beside, blocks)],
            "forecast_s": statistics.fmean(beside),
            "floor_s": f["floor_s"], "calibrated_here": calibrate,
            "peak_bytes": g.report.peak_bytes, "temp_bytes": g.report.temp_bytes,
            "minor_faults_per_step": faults / steps, "overrides": overrides, "job": job}


def _blocks(batches: list, n: int) -> list[list]:
    """`batches` in n blocks as even as they go (none empty)."""
    n = max(1, min(n, len(batches)))
    size, extra = divmod(len(batches), n)
    cuts = [i * size + min(i, extra) for i in range(n + 1)]
    return [batches[a:b] for a, b in itertools.pairwise(cuts)]


def _steps(g: Gated, state, target, batches: list) -> tuple[object, list[float]]:
    """The compiled step over `batches`, each step's seconds."""
    times = []
    for b in batches:
        t = time.perf_counter()
        state, m = g.compiled(state, target, b)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t)
    return state, times


def main() -> None:
    args = sys.argv[1:]
    flags = {a for a in args if a in ("--library", "--calibrate")}
    args = [a for a in args if a not in flags]
    steps, overrides = int(args[0]), args[1:]
    with tempfile.TemporaryDirectory() as d:
        if "--calibrate" in flags:  # no cached calibration: the gate measures it here
            os.environ[calibration.DIR_VAR] = str(Path(d) / "calibration")
        print(json.dumps(timed(overrides, steps, Path(d), "--library" not in flags,
                               "--calibrate" in flags)), flush=True)


if __name__ == "__main__":
    main()

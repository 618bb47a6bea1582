"""A run's training loop: the state to start from (the latest checkpoint, or fresh after
the faithfulness warmup), then the gated executable step after step, each followed by
what is due at its cadence: metrics, the gate's calibration, progress, the stop check and
the checkpoint."""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array

from pdecomp.core import processes as hosts
from pdecomp.core import sharding, storage
from pdecomp.core.units import GiB
from pdecomp.gate.step import Gated, calibrate, measured_memory
from pdecomp.plan.files import write_json
from pdecomp.run.checkpoint import Checkpointer
from pdecomp.run.evaluation import Learned, evaluate
from pdecomp.run.hooks import Hooks
from pdecomp.spd import plots
from pdecomp.spd.metrics import CI_HIST_EDGES
from pdecomp.spd.step import TrainState, faithfulness_warmup, init_state, scalars


class Interrupted(RuntimeError):
    """Training stopped early at `step` because the front end asked (a scheduler's signal);
    a checkpoint at that step is complete on disk."""

    def __init__(self, step: int, checkpoint_dir: Path):
        self.step = step
        super().__init__(f"stopped at step {step}; checkpoint in {checkpoint_dir}")


class NonFiniteLoss(FloatingPointError):
    """Training produced a NaN or an infinity; what was checkpointed before it is intact."""


def initial_state(g: Gated, target: Any, ckpt: Checkpointer, log: Callable[[str], None]
                  ) -> tuple[TrainState, int]:
    """The latest readable checkpoint and its step, or a fresh state (the components after
    the faithfulness warmup) and 0."""
    state, start = ckpt.restore_latest(g.state_abs, log)
    if start is not None:
        log(f"resumed from checkpoint at step {start}")
        return state, start
    # The target goes in as an argument: closed over, it would be copied into the program
    # as a constant, which a target split across processes cannot be.
    spec = g.run.step
    state = jax.jit(lambda k, t: init_state(k, spec, t),
                    out_shardings=sharding.shardings(g.state_abs))(g.init_key, target)
    components = jax.jit(lambda c, t: faithfulness_warmup(spec, c, t),
                         out_shardings=sharding.shardings(g.state_abs.components))(
        state.components, target)
    return eqx.tree_at(lambda s: s.components, state, components), 0


def train(g: Gated, target: Any, state: TrainState, start: int, ckpt: Checkpointer,
          run_dir: Path, hooks: Hooks) -> tuple[TrainState, list[dict[str, float]]]:
    """Steps start..optim.steps of the gated executable, each followed by what is due: the
    metrics (every logging.log_every steps, the first and the last), the gate's calibration
    (once, gate.calibrate_after steps in), progress, the stop check and the checkpoint
    (every logging.ckpt_every, the last, a stop). The final state and the metrics history."""
    run = g.run
    sample = run.kind.batch_sampler(run.config.model, run.config.data, run.config.seed,
                                    g.batch_sharding, g.data_key)
    # With more simulated CPU devices than cores, in-flight steps can starve the collective
    # rendezvous of threads; waiting on each step avoids that.
    sync_each = jax.default_backend() == "cpu" and g.mesh.size > 1
    steps, every = run.config.optim.steps, run.config.logging
    log = MetricsLog.resume(run_dir, start)
    for i in range(start, steps):
        state, m = g.compiled(state, target, sample(i))
        if sync_each:
            jax.block_until_ready(m)
        done = i + 1
        if done % every.log_every == 0 or done == steps or done == 1:  # 1: the start
            log.record(g, done, m, ckpt)
            if hooks.on_metrics:
                hooks.on_metrics(done, log.last)
        if due(every.eval_every, done, steps) or due(every.slow_eval_every, done, steps):
            log.evaluated(done, functools.partial(evaluate_now, g, target, state, done, run_dir))
            if hooks.on_metrics:
                hooks.on_metrics(done, log.history[-1])
        if done == start + run.config.gate.calibrate_after:
            calibrated(g, run_dir, done, hooks)
        if hooks.progress:
            hooks.progress(done, steps, log.last)
        stop = (hooks.should_stop is not None and done % every.stop_check_every == 0
                and hosts.any_process(hooks.should_stop()))
        if done % (every.ckpt_every or steps) == 0 or done == steps or stop:
            checkpoint(ckpt, run_dir, done, state, log.history)
        if stop and done < steps:
            ckpt.close()  # waits until the checkpoint is complete on disk
            raise Interrupted(done, ckpt.directory)
    ckpt.close()
    return state, log.history


def due(every: int, done: int, steps: int) -> bool:
    """Whether something done every `every` steps (0: never) is due after step `done`."""
    return bool(every) and (done % every == 0 or done == steps)


def evaluate_now(g: Gated, target: Any, state: TrainState, done: int, run_dir: Path
                 ) -> dict[str, float]:
    """The in-loop evaluation after step `done`, on the final evaluation's held-out batches:
    its figures as `eval/<key>` (the fast tier), and the slow tier's plots when due."""
    run = g.run
    summary, evaluated = evaluate(run, target, Learned(state.components, state.ci_fn),
                                  g.batch_sharding, final=False)
    slow = due(run.config.logging.slow_eval_every, done, run.config.optim.steps)
    if slow and hosts.is_main_process():
        plots.plot_ci_distribution(evaluated.ci, run_dir / "eval" / f"{done}",
                                   run.config.loss.ci_threshold, CI_HIST_EDGES)
    return {f"eval/{k}": float(v) for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def calibrated(g: Gated, run_dir: Path, done: int, hooks: Hooks) -> None:
    """The measured peak beside the gate's prediction, in gate.json and the metrics."""
    if not calibrate(g.report, g.mesh):
        return
    g.report.write(run_dir)
    if hooks.on_metrics:
        hooks.on_metrics(done, {
            "hbm/measured_peak_gib": g.report.measured_peak_bytes / GiB,
            "hbm/predicted_over_measured": g.report.predicted_over_measured})


@dataclass
class MetricsLog:
    """The logged metrics: every logged step's, in order (history.json), and the latest."""

    history: list[dict[str, float]]
    last: dict[str, float]
    start: int
    t_log: float

    @staticmethod
    def resume(run_dir: Path, start: int) -> MetricsLog:
        """What the first attempt logged up to `start`, the step a resume starts from."""
        history: list[dict[str, float]] = []
        if start and (run_dir / "history.json").exists():
            history = [h for h in json.loads((run_dir / "history.json").read_text())
                       if h["step"] <= start]
        return MetricsLog(history, dict(history[-1]) if history else {}, start,
                          time.perf_counter())

    def record(self, g: Gated, done: int, m: dict[str, Array], ckpt: Checkpointer) -> None:
        """Step `done`'s metrics with its speed and memory; NonFiniteLoss on a NaN or inf."""
        last = scalars(m, g.run.step.sites.names)
        if not all(math.isfinite(v) for v in last.values()):
            ckpt.wait()  # a save in flight counts once it is complete
            saved = ckpt.steps_newest_first()
            ckpt.close()
            kept = (f"the last checkpoint, step {saved[0]} in {ckpt.directory}, is intact"
                    if saved else "no checkpoint was written before it")
            raise NonFiniteLoss(f"non-finite loss at step {done}: {last}; {kept}")
        now = time.perf_counter()
        logged = [h["step"] for h in self.history if "perf/step_s" in h]
        n_steps = done - max(logged[-1] if logged else 0, self.start)
        last["perf/step_s"] = (now - self.t_log) / n_steps
        last["perf/examples_per_s"] = g.run.batch.size / last["perf/step_s"]
        if tokens := g.run.kind.tokens_per_example(g.run.config.data):
            last["perf/tokens_per_s"] = last["perf/examples_per_s"] * tokens
        self.t_log = now
        if forecast := (g.report.step or {}).get("forecast"):
            last["perf/forecast_step_s"] = forecast["s_per_step"]
        last["hbm/predicted_peak_gib"] = g.report.peak_bytes / GiB
        if measured := measured_memory(g.mesh):
            last["hbm/peak_gib"], last["hbm/in_use_gib"] = (b / GiB for b in measured)
        self.history.append({"step": done, **last})
        self.last = last

    def evaluated(self, done: int, evaluate: Callable[[], dict[str, float]]) -> None:
        """The in-loop evaluation's figures of step `done`, in that step's entry; its time
        is not counted in the steps' speed."""
        t0 = time.perf_counter()
        figures = evaluate()
        self.t_log += time.perf_counter() - t0
        if not (self.history and self.history[-1]["step"] == done):
            self.history.append({"step": done})
        self.history[-1].update(figures)


def forecast_over_measured(history: list[dict[str, float]]) -> float | None:
    """The gate's forecast of a step over the steps' measured time: the median of the
    logged intervals after the first (which holds the first step's compile and warm-up).
    The loop's own work between steps (metrics read back, logging) is in the measured
    time, as a user's clock sees it. None with fewer than two logged intervals."""
    timed = [h for h in history if "perf/step_s" in h][1:]
    if not timed or "perf/forecast_step_s" not in timed[-1]:
        return None
    return timed[-1]["perf/forecast_step_s"] / statistics.median(
        h["perf/step_s"] for h in timed)


def checkpoint(ckpt: Checkpointer, run_dir: Path, step: int, state: TrainState,
               history: list[dict[str, float]]) -> None:
    """The history, then the state at `step` (saved in the background). The history first:
    a resume keeps its entries up to the checkpoint it starts from, so it must never be older
    than that checkpoint, also when a full disk stops the run between the two writes."""
    try:
        write_json(run_dir / "history.json", history)
    except storage.WriteFailed:
        ckpt.close()  # a save in flight that failed on the same disk is the fault to report
        raise
    ckpt.save(step, state)

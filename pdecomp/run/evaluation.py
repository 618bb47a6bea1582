"""A run's final evaluation: live components and L0 per site on fresh held-out batches,
then its kind's own metrics, and the result's plots."""

from __future__ import annotations

import dataclasses as dc
from pathlib import Path
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pdecomp.core import processes as hosts
from pdecomp.core.config import EVAL_SEED_OFFSET
from pdecomp.plan.resolve import Run
from pdecomp.spd import metrics, plots
from pdecomp.spd.components import with_tied
from pdecomp.spd.step import TrainState


class Learned(NamedTuple):
    """What a decomposition learned: all that evaluation reads of a training state."""

    components: Any
    ci_fn: Any


class Evaluated(NamedTuple):
    """What the final evaluation read, as it read it (a toy's gathered whole on every
    process), and its per-site CI summary: what `draw` plots."""

    target: Any
    components: Any
    ci: dict[str, dict[str, Any]]


def evaluate(run: Run, target: Any, state: Learned | TrainState,
             batch_sharding: NamedSharding, final: bool = True
             ) -> tuple[dict[str, Any], Evaluated]:
    """Final metrics on fresh held-out batches: live components and L0 per site, then the
    kind's own (the ground-truth match of a toy, CE/KL per mask type of an LM; the fresh
    adversary's curve, `loss.eval_pgd.curve_to`, only when `final`). Numbers only, and
    what was evaluated."""
    kind = run.kind
    eval_key, batches = held_out_batches(run, batch_sharding)
    replicated = NamedSharding(batch_sharding.mesh, P())
    components = with_tied(state.components, dict(run.tied))
    target, components, ci_fn = kind.for_evaluation((target, components, state.ci_fn),
                                                    replicated)
    ci = metrics.ci_summary(target, components, ci_fn, batches, run.config.loss.ci_threshold,
                            replicated)
    summary: dict[str, Any] = {}
    for s, v in ci.items():
        summary[f"live/{s}"] = v["live"]
        summary[f"l0/{s}"] = v["l0"]
        summary[f"l0_any/{s}"] = v["l0_any"]
    spec = run.evaluation if final else dc.replace(
        run.evaluation, pgd=dc.replace(run.evaluation.pgd, curve_to=0))
    summary.update(kind.evaluate(run.config.model, spec, target, components, ci_fn, batches,
                                 eval_key, ci))
    return summary, Evaluated(target, components, ci)


def held_out_batches(run: Run, batch_sharding: NamedSharding) -> tuple[Any, list[Any]]:
    """The evaluation's key and its batches, fresh and held out (`data.eval_batches` of them,
    each in training's microbatches: a whole batch at once would need memory the step, which
    takes it in optim.microbatches pieces, never did)."""
    eval_key = jax.random.PRNGKey(run.config.seed + EVAL_SEED_OFFSET)
    micro = dc.replace(run.config.data, batch_size=run.batch.microbatch)
    sample = run.kind.batch_sampler(run.config.model, micro, run.config.seed, batch_sharding,
                                    eval_key, held_out=True)
    n = run.config.data.eval_batches * run.batch.microbatches
    return eval_key, [sample(i) for i in range(n)]


def draw(run: Run, evaluated: Evaluated, history: list[dict[str, float]],
         run_dir: Path) -> dict[str, str]:
    """The result's plots (rank 0, `logging.plots`): summary key -> file drawn."""
    if not run.config.logging.plots or not hosts.is_main_process():
        return {}
    thr, ci = run.config.loss.ci_threshold, evaluated.ci
    out = {"plots/mean_ci": str(plots.plot_mean_ci(ci, run_dir / "mean_ci.png", thr))}
    if history:
        out["plots/history"] = str(plots.plot_history(history, run_dir / "history.png"))
    return out | run.kind.plots(evaluated.target, evaluated.components, ci, thr, run_dir)

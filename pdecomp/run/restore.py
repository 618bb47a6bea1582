"""What a run directory's checkpoint holds a resumed run to: the same arrays (a changed
`layers.C`, `layers.sites`, model ... is refused) and the same schedule (unless
`optim.allow_schedule_change`), checked before anything is made."""

from __future__ import annotations

import dataclasses as dc
import math
from pathlib import Path
from typing import Any

import jax
import yaml

from pdecomp.core.config import ConfigError
from pdecomp.gate.shapes import abstract_run
from pdecomp.plan.files import CONFIG_FILE
from pdecomp.plan.resolve import Run
from pdecomp.run.checkpoint import Checkpointer, UnreadableCheckpoint

# The settings that are functions of the step, each laid out over optim.steps: the
# learning-rate schedules (components, CI function, PGD sources) and p's annealing. A
# resumed run that changed one would go on along another curve than its first steps took.
SCHEDULE_KEYS = ("optim.steps",
                 *(f"optim.{group}.{key}" for group in ("components", "ci_fn")
                   for key in ("lr", "schedule", "warmup_frac", "final_frac")),
                 "loss.pgd.lr", "loss.pgd.warmup_frac", "loss.p_start", "loss.p_end",
                 "loss.p_anneal_start_frac", "loss.p_anneal_end_frac")


def check_resumable(run: Run, run_dir: Path) -> None:
    """A run directory's newest readable checkpoint (the one the run resumes from) has the
    arrays this run trains, or it is an error naming the first that differs."""
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        return
    ckpt = Checkpointer(ckpt_dir)
    state_abs = abstract_run(run, jax.random.PRNGKey(run.config.seed))[1]
    why, resumed = None, None
    for step in ckpt.steps_newest_first():
        try:
            why = ckpt.mismatch(state_abs, step)
            resumed = step
            break
        except UnreadableCheckpoint:
            continue
    ckpt.close()
    if why:
        raise ConfigError("hydra.run.dir", str(run_dir), f"its checkpoint at step {step} {why}")
    if resumed is not None and not run.config.optim.allow_schedule_change:
        check_schedule(run, run_dir, resumed)


def check_schedule(run: Run, run_dir: Path, step: int) -> None:
    """A resume keeps the schedule its run was trained on (the run directory's config.yaml),
    or it is an error naming the first key that differs."""
    try:
        before = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError):
        return  # no record to hold the run to (a run directory from before config.yaml)
    now = dc.asdict(run.composed)
    for key in SCHEDULE_KEYS:
        old, new = _at(before, key), _at(now, key)
        if old is not None and not _same(old, new):
            raise ConfigError(key, new, f"the run in {run_dir} was trained to its checkpoint at "
                              f"step {step} with {key}={old!r}, and resuming with another "
                              f"value changes its schedule under it; keep {old!r}, or set "
                              "optim.allow_schedule_change=true")


def _at(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _same(a: Any, b: Any) -> bool:
    """Equal as values: YAML may hold 0.001 where the config has 1e-3 (or an int for 2.0)."""
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    except (TypeError, ValueError):
        return a == b

"""A finished (or checkpointed) run, opened for a look: `load_run(run_dir)`.

Everything comes from what the run wrote: the resolved run (run.json; config.yaml in a run
directory written before it, its paths read from the working directory), the trained
components and CI function (the latest checkpoint), the logged history and the summary. The
target is the one the config names (a toy from its cache, a Llama from its directory).
Everything is placed on one device, whatever mesh the run trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from jax.sharding import Mesh

from pdecomp import older_layout, sharding
from pdecomp.checkpoint import Checkpointer, complete_steps
from pdecomp.components import Components, with_tied
from pdecomp.config import RunConfig
from pdecomp.kinds import kind_of, run_config
from pdecomp.resolve import Run, resolve
from pdecomp.rundir import CONFIG_FILE, RUN_FILE, read_json
from pdecomp.shapes import abstract_run, load_target
from pdecomp.train import TrainState


class RunDirError(ValueError):
    """A directory `load_run` cannot open; `str()` names it and says why, in one line."""


@dataclass(frozen=True)
class LoadedRun:
    run_dir: Path
    run: Run  # as resolved when it trained
    target: Any  # the frozen target (toy_models.TMS, toy_models.ResidMLP, llama.Llama)
    components: Components  # every site's, tied followers included (V=Uᵀ of the leader)
    ci_fn: Any  # the CI function: ci_fn(site inputs, components) -> CI logits per site
    state: TrainState | None  # the whole checkpointed state (None: not read)
    step: int  # the checkpoint's step
    mesh: Mesh  # the mesh everything is placed on
    history: list[dict[str, float]]  # logged metrics ([] before the first log)
    summary: dict[str, Any] | None  # final metrics; None while the run is unfinished
    gate: dict[str, Any] | None  # the memory gate's report

    @property
    def config(self) -> RunConfig:
        """The config as resolved (absolute paths, settled batch and microbatches)."""
        return self.run.config


def read_config(run_dir: Path) -> RunConfig:
    """The run's config as resolved when it trained (run.json), or as composed
    (config.yaml) in a run directory from before run.json."""
    record = read_json(run_dir / RUN_FILE)
    if record is not None:
        return run_config(record["config"])
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        why = "does not exist" if not run_dir.is_dir() else f"has no {CONFIG_FILE}"
        raise RunDirError(f"{run_dir}: not a pdecomp run directory ({why})")
    return run_config(_model_of_its_kind(yaml.safe_load(path.read_text())))


def _model_of_its_kind(data: Any) -> Any:
    """Run directories written before each model kind had a schema of its own hold every
    kind's model fields in one flat mapping; the fields the run's kind does not have (unused
    by it) are dropped, so older runs open as they did."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        return data
    known = {f.name for f in fields(kind_of(str(model.get("kind", "tms"))).schema)}
    return {**data, "model": {k: v for k, v in model.items() if k in known}}


def analysis_mesh(devices: int) -> Mesh:
    """`devices` local devices as a mesh whose model axis spans them: each site's components
    and CI function split along C (mesh.rules' `comp: model`), the batch whole on each."""
    found = jax.devices()
    if not 1 <= devices <= len(found):
        raise RunDirError(f"{devices} devices asked for; this process has {len(found)} "
                          "(PDECOMP_CPU_DEVICES=N splits a CPU into N)")
    return Mesh(np.array(found[:devices]).reshape(1, devices), (sharding.AXIS, sharding.MODEL))


def checkpoints_of(run_dir: Path, whole_state: bool = True) -> Path:
    """The run's checkpoint directory, holding at least one checkpoint; RunDirError if not,
    or if its newest checkpoint is of an older layout and `whole_state` is wanted (a
    reader's share of one is restacked: `older_layout`)."""
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():  # not made here: opening a Checkpointer would create it
        raise RunDirError(f"{run_dir}: no checkpoints/ (a gate-only run, or one that "
                          "stopped before its first checkpoint)")
    if not (steps := complete_steps(ckpt_dir)):
        raise RunDirError(f"{run_dir}: no checkpoint in {ckpt_dir}")
    if whole_state:
        ckpt = Checkpointer(ckpt_dir)
        why = ckpt.older_layout(max(steps))
        ckpt.close()
        if why:
            raise RunDirError(f"{run_dir}: its checkpoint at step {max(steps)} {why}")
    return ckpt_dir


def placed_abstract(run: Run, mesh: Mesh) -> tuple[Any, TrainState]:
    """The run's target and state as shapes, in the shardings its `mesh.rules` give on
    `mesh`: what a reader restores into, or compiles for."""
    layout = sharding.Layout(mesh, dict(run.placement.mesh.rules))
    target_abs, state_abs = abstract_run(run, jax.random.PRNGKey(run.seed))
    return sharding.place(target_abs, layout), sharding.place(state_abs, layout)


def load_run(run_dir: str | Path, log: Callable[[str], None] = print,
             mesh: Mesh | None = None, whole_state: bool = True) -> LoadedRun:
    """The run in `run_dir` at its latest checkpoint, on `mesh` (default: one device) in
    the shardings its `mesh.rules` give there. Without `whole_state`, only the components
    and the CI function are read (`state` is None): what an analysis needs, a third of what
    training keeps. Raises RunDirError for a directory that is not a run or has no
    checkpoint. `log` hears about a toy target being trained (when the cache has none)."""
    run_dir = Path(run_dir).absolute()
    run = resolve(read_config(run_dir))
    ckpt_dir = checkpoints_of(run_dir, whole_state)
    mesh = mesh or analysis_mesh(1)
    target_abs, state_abs = placed_abstract(run, mesh)
    ckpt = Checkpointer(ckpt_dir)
    try:
        step = ckpt.latest_step()
        assert step is not None  # checkpoints_of found one
        fields = {"components": state_abs.components, "ci_fn": state_abs.ci_fn}
        if not whole_state and ckpt.older_layout(step):
            state, parts = None, _restacked(run_dir, ckpt.item_dir(step), fields, step)
        elif why := ckpt.mismatch(state_abs, step, () if whole_state else tuple(fields)):
            raise RunDirError(f"{run_dir}: its checkpoint at step {step} {why}")
        elif whole_state:
            state = ckpt.restore(state_abs, step)
            parts = {"components": state.components, "ci_fn": state.ci_fn}
        else:
            state, parts = None, ckpt.restore_fields(fields, step)
        components, ci_fn = parts["components"], parts["ci_fn"]
    finally:
        ckpt.close()
    target, _ = load_target(run, target_abs, log)
    return LoadedRun(run_dir=run_dir, run=run, target=target,
                     components=with_tied(components, dict(run.tied)), ci_fn=ci_fn,
                     state=state, step=step, mesh=mesh,
                     history=read_json(run_dir / "history.json") or [],
                     summary=read_json(run_dir / "summary.json"),
                     gate=read_json(run_dir / "gate.json"))


def _restacked(run_dir: Path, item_dir: Path, fields: dict[str, Any], step: int
               ) -> dict[str, Any]:
    """A reader's share of a checkpoint of the older layout, in this version's."""
    try:
        return older_layout.restack(older_layout.stored_fields(item_dir), fields)
    except ValueError as e:
        raise RunDirError(f"{run_dir}: its checkpoint at step {step}, of the layout before "
                          f"the state was stacked by group, does not fit the run's "
                          f"settings: {e}") from None

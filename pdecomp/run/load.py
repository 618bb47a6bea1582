"""A finished (or checkpointed) run, opened for a look: `load_run(run_dir)`.

Everything comes from what the run wrote: the resolved run (run.json; config.yaml in a run
directory written before it, its paths read from the working directory), the trained
components and CI function (the latest checkpoint), the logged history and the summary. The
target is the one the config names (a toy from its cache, a Llama from its directory).
Everything is placed on one device, whatever mesh the run trained on.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from pdecomp.core import sharding
from pdecomp.core.config import RunConfig
from pdecomp.core.exits import Refused
from pdecomp.core.storage import DamagedFile, read_json, read_yaml
from pdecomp.gate.shapes import abstract_run, load_target
from pdecomp.kinds import kind_of, run_config
from pdecomp.plan.files import CONFIG_FILE, RUN_FILE
from pdecomp.plan.resolve import Run, resolve
from pdecomp.run import older_layout
from pdecomp.run.checkpoint import Checkpointer, UnreadableCheckpoint, complete_steps
from pdecomp.spd.components import Components, with_tied
from pdecomp.spd.masks import OLD_SCOPE_NAMES
from pdecomp.spd.step import TrainState


class RunDirError(Refused):
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
        return _config_in(run_dir / RUN_FILE, lambda: _scopes_renamed(record["config"]))
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        why = "does not exist" if not run_dir.is_dir() else f"has no {CONFIG_FILE}"
        raise RunDirError(f"{run_dir}: not a pdecomp run directory ({why})")
    return _config_in(path, lambda: _scopes_renamed(_model_of_its_kind(read_yaml(path))))


def _config_in(path: Path, data: Callable[[], Any]) -> RunConfig:
    """The RunConfig `data()` holds; RunDirError naming `path` where it is not one (a file
    edited by hand, or of another program)."""
    try:
        return run_config(data())
    except DamagedFile:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RunDirError(f"{path}: not a run's config as pdecomp wrote it ({why}); restore "
                          "it") from None


def _scopes_renamed(data: Any) -> Any:
    """An adversary's scope under the name it has now, in a run directory written before
    the scopes were named for what they share (masks.OLD_SCOPE_NAMES)."""
    loss = data.get("loss") if isinstance(data, dict) else None
    if not isinstance(loss, dict):
        return data
    renamed = {k: {**v, "scope": OLD_SCOPE_NAMES.get(v.get("scope"), v.get("scope"))}
               if isinstance(v, dict) and "scope" in v else v for k, v in loss.items()}
    return {**data, "loss": renamed}


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


def check_agrees(run: Run, run_dir: Path) -> None:
    """RunDirError, in one line, when the run's newest checkpoint holds components or a CI
    function of other names, shapes or dtypes than its files describe (a run.json edited to
    another C or kind): found from the shapes and the checkpoint's metadata, before anything
    is compiled or read. A checkpoint whose metadata cannot be read is left to the reader."""
    ckpt_dir = checkpoints_of(run_dir, whole_state=False)
    _, state_abs = abstract_run(run, jax.random.PRNGKey(run.config.seed))
    ckpt = Checkpointer(ckpt_dir, quiet=True)
    try:
        step = max(complete_steps(ckpt_dir))
        if ckpt.older_layout(step):
            return
        why = ckpt.mismatch(state_abs, step, ("components", "ci_fn"))
    except UnreadableCheckpoint:
        return
    finally:
        ckpt.close()
    if why:
        raise RunDirError(f"{run_dir}: its checkpoint at step {step} {why}")


def placed_abstract(run: Run, mesh: Mesh) -> tuple[Any, TrainState]:
    """The run's target and state as shapes, in the shardings its `mesh.rules` give on
    `mesh`: what a reader restores into, or compiles for."""
    layout = sharding.Layout(mesh, dict(run.placement.mesh.rules))
    target_abs, state_abs = abstract_run(run, jax.random.PRNGKey(run.config.seed))
    return sharding.place(target_abs, layout), sharding.place(state_abs, layout)


def load_run(run_dir: str | Path, log: Callable[[str], None] = print,
             mesh: Mesh | None = None, whole_state: bool = True) -> LoadedRun:
    """The run in `run_dir` at its newest readable checkpoint, on `mesh` (default: one device) in
    the shardings its `mesh.rules` give there. Without `whole_state`, only the components
    and the CI function are read (`state` is None): what an analysis needs, a third of what
    training keeps. Raises RunDirError for a directory that is not a run or has no
    readable checkpoint. `log` hears about a toy target being trained (when the cache has
    none) and about a damaged checkpoint passed over for the one before."""
    run_dir = Path(run_dir).absolute()
    run = resolve(read_config(run_dir))
    ckpt_dir = checkpoints_of(run_dir, whole_state)
    mesh = mesh or analysis_mesh(1)
    target_abs, state_abs = placed_abstract(run, mesh)
    ckpt = Checkpointer(ckpt_dir, quiet=True)
    try:
        state, parts, step = _newest_readable(run_dir, ckpt, state_abs, whole_state, log)
    finally:
        ckpt.close()
    components, ci_fn = parts["components"], parts["ci_fn"]
    target, _ = load_target(run, target_abs, log)
    return LoadedRun(run_dir=run_dir, run=run, target=target,
                     components=with_tied(components, dict(run.tied)), ci_fn=ci_fn,
                     state=state, step=step, mesh=mesh,
                     history=read_json(run_dir / "history.json") or [],
                     summary=read_json(run_dir / "summary.json"),
                     gate=read_json(run_dir / "gate.json"))


def _newest_readable(run_dir: Path, ckpt: Checkpointer, state_abs: TrainState,
                     whole_state: bool, log: Callable[[str], None]
                     ) -> tuple[TrainState | None, dict[str, Any], int]:
    """(the whole state or None, the components and CI function, the step) of the newest
    checkpoint that can be read. A damaged one is passed over with a line to `log`, as
    training passes over it (a reader moves nothing aside); RunDirError when none can be
    read, or when one holds another run's state."""
    skipped = []
    for step in ckpt.steps_newest_first():
        try:
            return (*_read_step(run_dir, ckpt, state_abs, step, whole_state), step)
        except (RunDirError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - whatever orbax raises on damaged files
            why = f"{type(e).__name__}: {textwrap.shorten(str(e).strip(), 160)}"
            log(f"checkpoint at step {step} cannot be read ({why}); reading the one before")
            skipped.append(f"step {step}")
    raise RunDirError(f"{run_dir}: no checkpoint can be read ({', '.join(skipped)} damaged)")


def _read_step(run_dir: Path, ckpt: Checkpointer, state_abs: TrainState, step: int,
               whole_state: bool) -> tuple[TrainState | None, dict[str, Any]]:
    """The checkpoint at `step`: the whole state (or None) and its components and CI
    function; RunDirError where it holds another run's state."""
    fields = {"components": state_abs.components, "ci_fn": state_abs.ci_fn}
    if not whole_state and ckpt.older_layout(step):
        return None, _restacked(run_dir, ckpt.item_dir(step), fields, step)
    if why := ckpt.mismatch(state_abs, step, () if whole_state else tuple(fields)):
        raise RunDirError(f"{run_dir}: its checkpoint at step {step} {why}")
    if whole_state:
        state = ckpt.restore(state_abs, step)
        return state, {"components": state.components, "ci_fn": state.ci_fn}
    return None, ckpt.restore_fields(fields, step)


def _restacked(run_dir: Path, item_dir: Path, fields: dict[str, Any], step: int
               ) -> dict[str, Any]:
    """A reader's share of a checkpoint of the older layout, in this version's."""
    try:
        return older_layout.restack(older_layout.stored_fields(item_dir), fields)
    except ValueError as e:
        raise RunDirError(f"{run_dir}: its checkpoint at step {step}, of the layout before "
                          f"the state was stacked by group, does not fit the run's "
                          f"settings: {e}") from None

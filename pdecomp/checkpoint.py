"""Save and restore the whole TrainState with orbax.

Orbax writes each step to a temporary directory and renames it when complete, so a
killed job never leaves a partial checkpoint that `latest_step` would pick up. A complete
checkpoint can still be damaged afterwards (a disk or copy fault): `restore_latest` moves
such a step aside and resumes from the one before it.
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

UNREADABLE = ".unreadable"  # suffix of a step directory moved aside; orbax ignores it


class UnreadableCheckpoint(Exception):
    """A step whose metadata cannot be read."""


def is_array_like(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


class Checkpointer:
    def __init__(self, directory: str | Path, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                                 create=True),
            item_handlers=ocp.StandardCheckpointHandler())  # so item_metadata can read steps

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps_newest_first(self) -> list[int]:
        """Every complete step, newest first: the order a resume tries them in."""
        return sorted(self.manager.all_steps(), reverse=True)

    def save(self, step: int, state: eqx.Module) -> None:
        arrays, _ = eqx.partition(state, eqx.is_array)
        self.manager.save(step, args=ocp.args.StandardSave(arrays), force=True)

    def restore(self, state_like: eqx.Module, step: int | None = None) -> eqx.Module:
        """Restore into the structure (and shardings) of `state_like` (concrete or abstract)."""
        step = self.latest_step() if step is None else step
        arrays, static = eqx.partition(state_like, is_array_like)

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        # The item's handler reads the arrays; the manager's restore would add a barrier of
        # every process after the read, which a process whose read failed never reaches
        # (FSDP: each process reads only its own shards). restore_latest agrees instead.
        handler = ocp.StandardCheckpointHandler()
        try:
            restored = handler.restore(
                self.directory / str(step) / ocp.checkpoint_manager.DEFAULT_ITEM_NAME,
                args=ocp.args.StandardRestore(jax.tree.map(abstract, arrays)))
        finally:
            handler.close()
        return eqx.combine(restored, static)

    def restore_latest(self, state_like: eqx.Module, log: Callable[[str], None]
                       ) -> tuple[eqx.Module | None, int | None]:
        """The newest checkpoint that can be read, restored into `state_like`, and its step;
        (None, None) when there is none.

        A step that cannot be read is moved aside to `<step>.unreadable` (kept, and out of
        the way of the step being saved again) and the one before it is tried, so a damaged
        checkpoint costs the steps since the previous one and needs no one at the console
        (a requeued job). Every process of a job takes the same decision.
        """
        for step in self.steps_newest_first():
            try:
                state, why = self.restore(state_like, step), None
            except MemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever orbax raises on damaged files
                first = re.split(r"(?<=\.)\s", str(e).strip(), maxsplit=1)[0]
                state, why = None, f"{type(e).__name__}: {textwrap.shorten(first, 160)}"
                _quiet_abandoned_reads()
            failed = np.atleast_1d(why is not None)
            if jax.process_count() > 1:
                failed = multihost_utils.process_allgather(failed).reshape(-1)
            if not failed.any():
                return state, step
            if why is None:
                why = f"on process {', '.join(str(i) for i in np.flatnonzero(failed))}"
            aside = self.directory / f"{step}{UNREADABLE}"
            n = 1
            while aside.exists():  # an earlier fault's copy of the same step
                n += 1
                aside = self.directory / f"{step}{UNREADABLE}.{n}"
            if jax.process_index() == 0:
                (self.directory / str(step)).rename(aside)
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"pdecomp checkpoint {step} aside")
            self.manager.reload()
            log(f"checkpoint at step {step} cannot be read ({why});"
                f" moved to {aside}")
            if not self.manager.all_steps():
                log("no checkpoint can be read: training starts from step 0")
        return None, None

    def mismatch(self, state_like: eqx.Module, step: int) -> str | None:
        """Why the checkpoint at `step` holds another run's state (other array names,
        shapes or dtypes), in one line; None when it fits. Raises UnreadableCheckpoint when
        its metadata cannot be read."""
        try:
            saved = _by_name(self.manager.item_metadata(step))
        except Exception as e:  # noqa: BLE001 - whatever orbax raises on a damaged step
            raise UnreadableCheckpoint(f"{type(e).__name__}: {e}") from None
        wanted = _by_name(eqx.filter(state_like, is_array_like))
        for name in sorted(saved.keys() | wanted.keys()):
            there, here = saved.get(name), wanted.get(name)
            if there != here:
                def show(x):
                    return "absent" if x is None else f"{x[1]}{list(x[0])}"
                return (f"holds another run's state: {name} is {show(there)} there, "
                        f"{show(here)} in this run; resume with that run's settings or choose "
                        "a new directory")
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _quiet_abandoned_reads() -> None:
    """After a failed read orbax abandons the step's other reads. Each fails again later,
    when its coroutine is collected or when it completes into the closed event loop, and
    most print a traceback through `sys.unraisablehook` as they do: from now on in this
    process those are dropped (tensorstore prints some itself)."""
    hook = sys.unraisablehook
    if getattr(hook, "quiets_abandoned_reads", False):
        return

    def quiet(unraisable) -> None:
        late = isinstance(unraisable.exc_value, RuntimeError) and \
            "Event loop is closed" in str(unraisable.exc_value)
        if not (late or inspect.iscoroutine(unraisable.object)):
            hook(unraisable)

    quiet.quiets_abandoned_reads = True
    sys.unraisablehook = quiet


def _by_name(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """Array leaves by a dotted name that orbax's metadata and the live pytree share."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if leaf is None:
            continue
        name = ".".join(re.findall(r"\w+", jax.tree_util.keystr(path)))
        out[name] = (tuple(leaf.shape), str(leaf.dtype))
    return out

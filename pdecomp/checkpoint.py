"""Save and restore the whole TrainState with orbax.

Orbax writes each step to a temporary directory and renames it when complete, so a
killed job never leaves a partial checkpoint that `latest_step` would pick up.
"""

from __future__ import annotations

import re
from pathlib import Path

import equinox as eqx
import jax
import orbax.checkpoint as ocp


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

    def save(self, step: int, state: eqx.Module) -> None:
        arrays, _ = eqx.partition(state, eqx.is_array)
        self.manager.save(step, args=ocp.args.StandardSave(arrays), force=True)

    def restore(self, state_like: eqx.Module, step: int | None = None) -> eqx.Module:
        """Restore into the structure (and shardings) of `state_like` (concrete or abstract)."""
        step = self.latest_step() if step is None else step
        arrays, static = eqx.partition(state_like, is_array_like)

        def abstract(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

        restored = self.manager.restore(
            step, args=ocp.args.StandardRestore(jax.tree.map(abstract, arrays)))
        return eqx.combine(restored, static)

    def mismatch(self, state_like: eqx.Module, step: int) -> str | None:
        """Why the checkpoint at `step` cannot be restored into `state_like` (unreadable, or
        other array names, shapes or dtypes), in one line; None when it fits."""
        try:
            saved = _by_name(self.manager.item_metadata(step))
        except Exception as e:  # noqa: BLE001 - whatever orbax raises on a damaged step
            earlier = [s for s in self.manager.all_steps() if s < step]
            where = f"resume from step {max(earlier)}" if earlier else "start over"
            return (f"cannot be read ({type(e).__name__}); move {self.directory / str(step)} "
                    f"aside to {where}")
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


def _by_name(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """Array leaves by a dotted name that orbax's metadata and the live pytree share."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if leaf is None:
            continue
        name = ".".join(re.findall(r"\w+", jax.tree_util.keystr(path)))
        out[name] = (tuple(leaf.shape), str(leaf.dtype))
    return out

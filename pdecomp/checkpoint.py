"""Save and restore the whole TrainState with orbax.

Orbax writes each step to a temporary directory and renames it when complete, so a
killed job never leaves a partial checkpoint that `latest_step` would pick up.
"""

from __future__ import annotations

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
                                                                 create=True))

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

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

"""A run's arrays as shapes: the frozen target and the training state from `eval_shape`
(nothing allocated, nothing trained), their bytes per device by part, and the target
loaded into the shardings they were given."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from pdecomp.core import sharding
from pdecomp.gate import compiled as gate_lib
from pdecomp.plan.resolve import Run
from pdecomp.spd.step import TrainState, init_state

# The argument part of the optimizer moments, and its name when they live in host memory.
OPT_PART, OPT_PART_HOST = "optimizer moments", "optimizer moments (host)"


def abstract_run(run: Run, key: Array) -> tuple[Any, TrainState]:
    """The target and the training state as shapes."""
    target_abs = jax.eval_shape(lambda k: run.kind.init_target(
        k, run.config.model, jnp.dtype(run.config.memory.target_dtype)), key)
    return target_abs, jax.eval_shape(lambda k, t: init_state(k, run.step, t), key, target_abs)


def load_target(run: Run, target_abs: Any, log: Callable[[str], None]
                ) -> tuple[Any, dict[str, Any]]:
    """The frozen target, in the shardings of `target_abs`, as its kind loads it."""
    return run.kind.load(run.config.model, run.config.layers, run.config.memory.target_dtype,
                         sharding.shardings(target_abs), log)


def argument_parts(run: Run, target_abs: Any, state_abs: TrainState, batch_abs: Any
                   ) -> dict[str, int]:
    """The step's argument bytes per device by part, counted from shapes and shardings."""
    return {"frozen target": gate_lib.tree_bytes(target_abs),
            "components": gate_lib.tree_bytes(state_abs.components),
            "ci function": gate_lib.tree_bytes(state_abs.ci_fn),
            OPT_PART_HOST if run.config.memory.offload_opt_state else OPT_PART:
                gate_lib.tree_bytes((state_abs.comp_opt, state_abs.ci_opt)),
            "adversary": gate_lib.tree_bytes(state_abs.adversary),
            "step and key": gate_lib.tree_bytes((state_abs.step, state_abs.key)),
            "batch": gate_lib.tree_bytes(batch_abs)}

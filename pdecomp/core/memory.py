"""How a run spends device memory, resolved once from `memory.*` into the `MemoryPolicy` the
step and the targets read whole: the compute and matmul precision, what the recon forwards
and the scanned site layers rematerialize (and what they keep), whether the CI function's
output is streamed, the positions per chunk of the KL and CE, and whether the optimizer
moments live on the host."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pdecomp.core.config import MemoryConfig

_cp = jax.checkpoint_policies
# The recon forwards' remat by name (`memory.remat`): remat_names -> the `jax.checkpoint`
# policy; False: no rematerialization, None: save nothing but the inputs.
REMAT: dict[str, Callable[[Sequence[str]], Callable | None | bool]] = {
    "none": lambda names: False,
    "full": lambda names: None,
    "save_dots": lambda names: _cp.dots_with_no_batch_dims_saveable,
    "names": lambda names: _cp.save_only_these_names(*names),
    "offload": lambda names: _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src="device", offload_dst="pinned_host"),
}
# What a rematerialized run of site layers keeps per layer (`memory.site_layer_saves`), in
# order of what they keep, most first (a refusal names those after the run's): every
# batchless matmul, the components' inner activations and the site outputs, or nothing.
SITE_LAYER_SAVES: dict[str, Callable | None] = {
    "linears": _cp.dots_with_no_batch_dims_saveable,
    "sites": _cp.save_only_these_names("site_inner", "site_out"),
    "nothing": None,
}


@dataclass(frozen=True)
class MemoryPolicy:
    """The memory plan of a step (docs/config.md, `memory`)."""

    compute_dtype: Any = "float32"
    matmul_dtype: Any = None  # the forwards' matmul operands (None: compute_dtype)
    remat: str = "none"  # a name in REMAT
    remat_names: tuple[str, ...] = ("layer_out",)
    stream_ci: bool = False
    logits_chunk: int = 0  # positions per chunk of the KL and CE (0: whole)
    remat_layers: bool = False
    site_layer_saves: str = "linears"  # a name in SITE_LAYER_SAVES
    offload_opt_state: bool = False

    @classmethod
    def of(cls, memory: MemoryConfig) -> MemoryPolicy:
        return cls(memory.compute_dtype, memory.matmul_dtype, memory.remat,
                   tuple(memory.remat_names), memory.stream_ci, memory.logits_chunk,
                   memory.remat_layers, memory.site_layer_saves, memory.offload_opt_state)

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    @property
    def recon_policy(self) -> Callable | None | bool:
        """The recon forwards' `jax.checkpoint` policy (False: none)."""
        return REMAT[self.remat](self.remat_names)

    @property
    def site_layer_policy(self) -> Callable | None:
        return SITE_LAYER_SAVES[self.site_layer_saves]


# float32, nothing rematerialized or streamed: what a plain forward (an evaluation's, a
# test's) computes with.
PLAIN = MemoryPolicy()

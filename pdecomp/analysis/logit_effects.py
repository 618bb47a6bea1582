"""The tokens each component promotes and suppresses through the rest of the model.

Component c of a site writes U[c] (times its activation) into the site's output. Where a
fixed linear map carries that output into the residual stream (the kind says where:
`Kind.direct_logits`; for a Llama the o_proj and down_proj sites, and v_proj through
o_proj), the unembedding turns it into a change of every next-token logit: the direct
path, the standard first reading of what a write does to the prediction (later layers,
which may amplify or cancel it, are left out). Per component the tokens with the largest
and the most negative change are kept. The [C, vocab] products are made on the devices the
components live on, a block of rows at a time, so that only the kept tokens come back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdecomp.kinds import kind_of

BLOCK_ELEMENTS = 1 << 25  # rows of [rows, vocab] logits made at once: 128 MiB of float32


@dataclass(frozen=True)
class TokenEffects:
    """Per component, the `k` tokens whose logit one unit of its output raises most
    (`promoted`, descending) and lowers most (`suppressed`, most negative first)."""

    promoted_ids: np.ndarray  # [C, k]
    promoted: np.ndarray  # [C, k] logit change per unit of activation
    suppressed_ids: np.ndarray
    suppressed: np.ndarray


@partial(jax.jit, static_argnames=("kind", "site", "k"))
def _extremes(target: Any, U: jax.Array, kind: str, site: str, k: int) -> tuple[jax.Array, ...]:
    logits = kind_of(kind).direct_logits(target, site, U.astype(jnp.float32))
    top, top_ids = jax.lax.top_k(logits, k)
    low, low_ids = jax.lax.top_k(-logits, k)
    return top_ids, top, low_ids, -low


def site_effects(kind: str, target: Any, site: str, U: jax.Array, k: int
                 ) -> TokenEffects | None:
    """The site's components' promoted and suppressed tokens; None where its kind sees no
    direct path from the site to the logits."""
    probe = jax.eval_shape(lambda u: kind_of(kind).direct_logits(target, site, u), U[:1])
    if probe is None:
        return None
    rows = max(1, BLOCK_ELEMENTS // probe.shape[-1])
    blocks = [jax.device_get(_extremes(target, U[a:a + rows], kind, site, k))
              for a in range(0, U.shape[0], rows)]
    return TokenEffects(*(np.concatenate(parts) for parts in zip(*blocks)))

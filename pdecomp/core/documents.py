"""Documents packed in a window. A token file that records where its documents start
(`data.documents`) gives windows whose positions attend only within their own document and
count their RoPE position from its start, as each document would alone.

Where a document starts travels in the token batch itself, as a flag bit on its first id:
a batch stays one int32 [b, t] array, so its shape, sharding, microbatches and gate are
those of a batch without documents. A window's first position starts a segment whether or
not a document starts there (the rest of a document cut by the window's start counts from
it). Every reader of ids takes them through `ids`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

START = 1 << 30  # above every vocabulary's ids, below int32's sign bit


def ids(batch: Int[Array, "b t"]) -> Int[Array, "b t"]:
    """The token ids of a batch, document flags cleared."""
    return batch & (START - 1)


def mark(windows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """`windows` [b, t] with the flag set where `starts` [b, t] (bool) is: a document
    starts there."""
    return np.where(starts, windows | START, windows)


def segments(batch: Int[Array, "b t"]) -> tuple[Int[Array, "b t"], Int[Array, "b t"]]:
    """(position of each token in its document, counted from 0 at its start or the
    window's; its document's index within the window)."""
    t = jnp.arange(batch.shape[-1], dtype=jnp.int32)
    starts = (batch & START) != 0
    last_start = jax.lax.cummax(jnp.where(starts, t, 0), axis=batch.ndim - 1)
    return t - last_start, jnp.cumsum(starts, axis=-1, dtype=jnp.int32)


def same_document(segment: Int[Array, "b t"]) -> Bool[Array, "b 1 1 t t"]:
    """Query i may see key j (in the attention's [b, groups, heads, q, k] layout) when both
    are in one document."""
    return (segment[:, :, None] == segment[:, None, :])[:, None, None]

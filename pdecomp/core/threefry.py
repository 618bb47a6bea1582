"""`uniform` and `bernoulli` with the same bits as `jax.random`'s, fused into one kernel.

jax lowers its Threefry-2x32 hash on CPU as a rolled loop of five steps, each a separate
pass over the whole array; the mask sources of a TMS step spent a fifth of the step there.
Written out as straight-line jnp, XLA fuses the 20 rounds with the conversion to float and
with whatever consumes the result (2.3x faster for the sources of a TMS 5-2 step). The
counters are laid out as jax's partitionable Threefry lays them out (the default), so a
key gives exactly the values `jax.random` gives; tests/test_semantics.py pins that.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PRNGKeyArray

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # Threefry's key-schedule constant


def _rotate_left(x: Array, r: int) -> Array:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _threefry2x32(k0: Array, k1: Array, x0: Array, x1: Array) -> tuple[Array, Array]:
    """Threefry-2x32 with 20 rounds (Salmon et al., 2011): a keyed hash of (x0, x1)."""
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotate_left(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _bits(key: PRNGKeyArray, shape: tuple[int, ...]) -> Array:
    """32 random bits per element: the hash of the element's row-major index."""
    k = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    index = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    hi, lo = _threefry2x32(k[0], k[1], jnp.zeros_like(index), index)
    return hi ^ lo


def _fused(key: PRNGKeyArray, shape: tuple[int, ...]) -> bool:
    # Past 2^32 elements the index needs a second word; another PRNG (rbg) or jax's older
    # counter layout would give other values: all go to jax.random.
    # (getattr: a jax where the layout is no longer optional may drop the flag)
    if math.prod(shape) >= 2**32 or not getattr(jax.config, "jax_threefry_partitionable", True):
        return False
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key)) == "threefry2x32"
    return key.shape == (2,) and getattr(jax.config, "jax_default_prng_impl",
                                         "threefry2x32") == "threefry2x32"


def uniform_rows(key: PRNGKeyArray, rows: Array, width: int, n_rows: int
                 ) -> Float[Array, "..."]:  # noqa: UP037 - a jaxtyping shape
    """Rows `rows` (uint32 indices, any shape) of `uniform(key, (n_rows, width))`, as
    [*rows.shape, width], without drawing the other rows.

    A microbatch, or a shard, draws exactly its own part of the whole batch's values, so a
    step split into microbatches sees the numbers of the unsplit step. Below 2^32 elements
    the counter is the element's row-major index (jax's values, as `uniform`); above, where
    that index needs two words, the counter is the pair (row, column): the values then differ
    from jax.random's, but are still the same for every split of the rows.
    """
    if not _fused(key, (1,)):
        return jax.random.uniform(key, (n_rows, width), jnp.float32)[rows]
    k = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    rows = rows.astype(jnp.uint32)[..., None]
    col = jax.lax.broadcasted_iota(jnp.uint32, (*rows.shape[:-1], width), rows.ndim - 1)
    if n_rows * width < 2**32:
        hi, lo = jnp.zeros_like(col), rows * np.uint32(width) + col
    else:
        hi, lo = jnp.broadcast_to(rows, col.shape), col
    hi, lo = _threefry2x32(k[0], k[1], hi, lo)
    return _to_unit(hi ^ lo)


def _to_unit(bits: Array) -> Array:
    # 23 random mantissa bits under exponent 0: a float in [1, 2), minus 1
    one_to_two = (bits >> np.uint32(9)) | np.uint32(0x3F800000)
    return jax.lax.bitcast_convert_type(one_to_two, jnp.float32) - 1.0


def uniform(key: PRNGKeyArray, shape: tuple[int, ...], minval: float = 0.0,
            maxval: float = 1.0) -> Float[Array, "..."]:  # noqa: UP037 - a jaxtyping shape
    """U[minval, maxval) in float32, equal to `jax.random.uniform(key, shape, jnp.float32,
    minval, maxval)`."""
    if not _fused(key, shape):
        return jax.random.uniform(key, shape, jnp.float32, minval, maxval)
    unit = _to_unit(_bits(key, shape))
    lo, hi = jnp.float32(minval), jnp.float32(maxval)
    return jnp.maximum(lo, unit * (hi - lo) + lo)


def bernoulli(key: PRNGKeyArray, p: float | Array, shape: tuple[int, ...]
              ) -> Bool[Array, "..."]:  # noqa: UP037 - a jaxtyping shape
    """True with probability p, equal to `jax.random.bernoulli(key, p, shape)`."""
    return uniform(key, shape) < p

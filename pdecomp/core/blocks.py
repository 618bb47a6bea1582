"""Transformer pieces that the Llama target and the global CI transformer both compute:
RMSNorm and rotary position embeddings (RoPE, with Llama-3's frequency scaling)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


def rope_inv_freq(d: int, theta: float, scaling: dict[str, Any] | None = None) -> np.ndarray:
    """Per-pair rotation frequencies of a head of size d, with Llama-3 scaling: long
    wavelengths slowed by `factor`, short ones kept, the band between interpolated smoothly."""
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv_freq.astype(np.float32)
    if kind != "llama3":  # config.rope_problem refuses it before a model is built
        raise ValueError(f"rope_scaling type {kind!r} is not supported; allowed: llama3")
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(inv_freq: np.ndarray, t: int) -> tuple[Array, Array]:
    """cos, sin [t, 1 (heads), d_head] in fp32 for positions 0..t-1, in the half-split
    layout of `apply_rope`."""
    freqs = np.arange(t, dtype=np.float32)[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return jnp.asarray(np.cos(emb)), jnp.asarray(np.sin(emb))


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def apply_rope(x: Float[Array, "*b t h d"], cos: Array, sin: Array) -> Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)

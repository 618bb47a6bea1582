"""The toy targets: TMS and the residual MLP (Equinox modules whose `__call__(x, linear)`
routes every site's matmul through the caller's `linear(site, x, W)`), the sparse features
they read, and the check that a trained one represents every feature."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from pdecomp.core import threefry
from pdecomp.core.memory import PLAIN, MemoryPolicy
from pdecomp.spd.components import LinearFn, SiteLinear, frozen_linear


def _whole_forward(target, memory: MemoryPolicy) -> tuple[Callable, Callable]:
    """A toy's (prefix, suffix): no layer is worth skipping, so the prefix only casts to
    the compute dtype and every forward runs the whole model (the LM-only `streams` and
    `live` are ignored); its sites' matmuls take `memory.matmul_dtype` operands."""
    def suffix(x, linear, streams=None, live=None):
        if isinstance(linear, SiteLinear):
            linear = replace(linear, operand=memory.matmul_dtype)
        return target(x, linear)

    return (lambda x: x.astype(memory.dtype)), suffix


class TMS(eqx.Module):
    """Toy model of superposition: h = x @ W, out = ReLU(h @ Wᵀ + b), tied weights.

    The +ID variants put fixed identity layers between linear1 and linear2.
    """

    W: Float[Array, "n m"]
    b: Float[Array, " n"]
    hidden: list[Float[Array, "m m"]]

    def __call__(self, x: Float[Array, "*pos n"], linear: LinearFn = frozen_linear) -> Array:
        h = linear("linear1", x, self.W)
        for name, H in zip(self._hidden_names(), self.hidden):
            h = linear(name, h, H)
        return jax.nn.relu(linear("linear2", h, self.W.T) + self.b)

    def split(self, sites: Sequence[str], memory: MemoryPolicy = PLAIN
              ) -> tuple[Callable, Callable]:
        del sites
        return _whole_forward(self, memory)

    def _hidden_names(self) -> list[str]:
        n = len(self.hidden)
        return ["hidden"] if n == 1 else [f"hidden.{i}" for i in range(n)]

    def site_weights(self) -> dict[str, Array]:
        return {"linear1": self.W, **dict(zip(self._hidden_names(), self.hidden)),
                "linear2": self.W.T}


class ResidMLP(eqx.Module):
    """Residual MLP: features embedded by a fixed W_E, ReLU MLP layers, read out by W_Eᵀ."""

    W_E: Float[Array, "n d"]
    W_in: list[Float[Array, "d h"]]
    b_in: list[Float[Array, " h"]]
    W_out: list[Float[Array, "h d"]]
    b_out: list[Float[Array, " d"]]

    def __call__(self, x: Float[Array, "*pos n"], linear: LinearFn = frozen_linear) -> Array:
        resid = x @ self.W_E
        for i in range(len(self.W_in)):
            h = jax.nn.relu(linear(f"layers.{i}.mlp_in", resid, self.W_in[i]) + self.b_in[i])
            resid = resid + linear(f"layers.{i}.mlp_out", h, self.W_out[i]) + self.b_out[i]
        return resid @ self.W_E.T

    def split(self, sites: Sequence[str], memory: MemoryPolicy = PLAIN
              ) -> tuple[Callable, Callable]:
        del sites
        return _whole_forward(self, memory)

    def site_weights(self) -> dict[str, Array]:
        out = {}
        for i in range(len(self.W_in)):
            out[f"layers.{i}.mlp_in"] = self.W_in[i]
            out[f"layers.{i}.mlp_out"] = self.W_out[i]
        return out


def sample_features(key: PRNGKeyArray, n_features: int, prob: float, batch_size: int,
                    low: float) -> Float[Array, "batch n"]:
    """Sparse features: each active with probability `prob`, its value U[low, 1]."""
    k_on, k_val = jax.random.split(key)
    on: Bool[Array, "batch n"] = threefry.bernoulli(k_on, prob, (batch_size, n_features))
    val = threefry.uniform(k_val, (batch_size, n_features), low, 1.0)
    return jnp.where(on, val, 0.0)


def init_tms(key: PRNGKeyArray, n: int, m: int, n_hidden_layers: int) -> TMS:
    W = jax.random.normal(key, (n, m), jnp.float32) * jnp.sqrt(2.0 / (n + m))
    hidden = [jnp.eye(m, dtype=jnp.float32) for _ in range(n_hidden_layers)]
    return TMS(W, jnp.zeros((n,), jnp.float32), hidden)


def init_resid_mlp(key: PRNGKeyArray, n: int, d: int, h: int, n_layers: int) -> ResidMLP:
    k_e, *ks = jax.random.split(key, 1 + 2 * n_layers)
    W_E = jax.random.normal(k_e, (n, d), jnp.float32)
    W_E = W_E / jnp.linalg.norm(W_E, axis=-1, keepdims=True)
    W_in = [jax.random.normal(ks[2 * i], (d, h)) * jnp.sqrt(1.0 / d) for i in range(n_layers)]
    W_out = [jax.random.normal(ks[2 * i + 1], (h, d)) * jnp.sqrt(1.0 / h)
             for i in range(n_layers)]
    return ResidMLP(W_E, W_in, [jnp.zeros((h,)) for _ in range(n_layers)], W_out,
                    [jnp.zeros((d,)) for _ in range(n_layers)])

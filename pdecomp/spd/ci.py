"""Causal-importance (CI) functions and the two leaky squashings of their logits.

`ci_lower` feeds every mask; `ci_upper` feeds importance minimality only (docs/method.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from pdecomp.core.config import LayersConfig
from pdecomp.spd.ci_global import GlobalCITransformer
from pdecomp.spd.components import Components, Groups

ALPHA = 0.01
# The block-diagonal form (see `_block_diagonal`) runs in groups of this many components;
# above _BLOCK_DIAG_MAX_C components the unrolled groups would bloat the program.
_BLOCK_DIAG_GROUP = 10
_BLOCK_DIAG_MAX_C = 256


@jax.custom_vjp
def ci_lower(x: Array) -> Array:
    """Forward clamp(x, 0, 1); the backward lets a logit stuck below 0 climb back (leaky)."""
    return jnp.clip(x, 0.0, 1.0)


def _ci_lower_fwd(x: Array) -> tuple[Array, Array]:
    return ci_lower(x), x


def _ci_lower_bwd(x: Array, g: Array) -> tuple[Array]:
    inside = (x > 0) & (x <= 1)
    # Below 0 only a push upward (g < 0 under gradient descent) passes, scaled by ALPHA.
    below = (x <= 0) & (g < 0)
    return (jnp.where(inside, g, jnp.where(below, ALPHA * g, jnp.zeros_like(g))),)


ci_lower.defvjp(_ci_lower_fwd, _ci_lower_bwd)


def ci_upper(x: Array) -> Array:
    """`1 + α(x − 1)` above 1, else clamp(x, 0, 1); plain autodiff."""
    return jnp.where(x > 1, 1 + ALPHA * (x - 1), jnp.clip(x, 0.0, 1.0))


def _init_layers(key: PRNGKeyArray, shapes: list[tuple[int, ...]]) -> list[Array]:
    """Normal weights with std gain/√fan_in, fan_in = shape[-2]: He gain √2 for layers that
    feed a GELU, gain 1 for the linear output layer (as the paper's reference code)."""
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, shape, jnp.float32)
            * jnp.sqrt((2.0 if i < len(shapes) - 1 else 1.0) / shape[-2])
            for i, (k, shape) in enumerate(zip(keys, shapes))]


def _per_component_dense(h: Array, w: Float[Array, "C fan_in fan_out"]) -> Array:
    """h [*pos, C or 1, fan_in] through each component's own [fan_in, fan_out] matrix.

    Width-1 sides are broadcasts, not batched dots: XLA:CPU runs C tiny batched matmuls
    several times slower than the same arithmetic written elementwise. An input shared by
    every component (C axis 1: `vector_mlp`'s site input) is contracted with all their
    weights at once, one [*pos, fan_in] x [fan_in, C * fan_out] matmul, and never copied
    per component: that copy was [*pos, C, fan_in], the step's largest buffer (3 GiB for
    a 1536-wide site at C = 512 and 1024 tokens), forward and backward.
    """
    if w.shape[1] == 1:
        return h * w[:, 0, :]
    if h.shape[-2] == 1:
        return jnp.einsum("...i,cio->...co", h[..., 0, :], w)
    if w.shape[2] == 1:
        return jnp.sum(h * w[:, :, 0], axis=-1, keepdims=True)
    return jnp.einsum("...ci,cio->...co", h, w)


class ComponentwiseMLP(eqx.Module):
    """C independent MLPs evaluated together: weights carry a leading C axis.

    `mlp` feeds component c its inner activation `x @ V[:, c]` (d_in = 1); `vector_mlp`
    feeds every component the whole site input (d_in = the site's input width).
    """

    weights: list[Float[Array, "C fan_in fan_out"]]
    biases: list[Float[Array, "C fan_out"]]
    on_inner_acts: bool = eqx.field(static=True)

    @staticmethod
    def init(key: PRNGKeyArray, C: int, d_in: int, hidden: list[int],
             on_inner_acts: bool) -> ComponentwiseMLP:
        dims = [1 if on_inner_acts else d_in, *hidden, 1]
        ws = _init_layers(key, [(C, a, b) for a, b in itertools.pairwise(dims)])
        bs = [jnp.zeros((C, b), jnp.float32) for b in dims[1:]]
        return ComponentwiseMLP(ws, bs, on_inner_acts)

    def __call__(self, x: Float[Array, "*pos d_in"], V: Float[Array, "d_in C"]
                 ) -> Float[Array, "*pos C"]:
        if self.on_inner_acts and len(self.weights) == 2 and V.shape[1] <= _BLOCK_DIAG_MAX_C:
            # Chosen when the step is lowered, for the platform it is compiled for (a
            # deviceless GPU gate traces on a CPU host): on GPU the block-diagonal groups
            # only cost memory (3.7x the CI temporaries of the resid MLP 3 step).
            return jax.lax.platform_dependent(self, x, V, cpu=ComponentwiseMLP._block_diagonal,
                                              default=ComponentwiseMLP._elementwise)
        return self._elementwise(x, V)

    def _elementwise(self, x: Array, V: Array) -> Array:
        if self.on_inner_acts:
            h = (x @ V.astype(x.dtype))[..., None]  # [*pos, C, 1]
        else:
            h = x[..., None, :]  # [*pos, 1, d_in]: every component sees the whole input
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = _per_component_dense(jax.nn.gelu(h) if i else h, w.astype(h.dtype)) + b
        return h[..., 0].astype(jnp.float32)

    def _block_diagonal(self, x: Array, V: Array) -> Array:
        """The same one-hidden-layer MLPs as dense matmuls with block-diagonal weights, one
        group of components at a time.

        A group of g components does g times the arithmetic of the elementwise form but
        runs faster on XLA:CPU (and is used there only): dense matmuls are vectorised and
        multi-threaded, while XLA:CPU turns the elementwise form's reductions into
        broadcasts it materialises. Measured at batch 4096 (fwd + bwd, one site): C = 200
        in groups of 10, 75 ms against 116 ms elementwise. Results agree to float rounding.
        """
        w1_all, w2_all = self.weights[0][:, 0, :], self.weights[1][:, :, 0]  # [C, H] each
        b1_all, b2_all = self.biases[0], self.biases[1][:, 0]
        C, H = w1_all.shape
        V = V.astype(x.dtype)
        # Folding V into each group's first layer (x @ (V_g @ w1)) beats one x @ V and
        # narrow per-group matmuls while the input is no wider than a group's hidden layer
        # (TMS: 12.1 → 11.4 ms per step); for wide inputs (resid MLP, d_in 1000) it is the
        # other way round (164 against 122 ms).
        fold_V = x.shape[-1] <= _BLOCK_DIAG_GROUP * H
        inner = None if fold_V else x @ V  # [*pos, C], once for all groups
        outs = []
        for lo in range(0, C, _BLOCK_DIAG_GROUP):
            hi = min(lo + _BLOCK_DIAG_GROUP, C)
            eye = jnp.eye(hi - lo, dtype=x.dtype)
            w1 = (eye[:, :, None] * w1_all[lo:hi].astype(x.dtype)[None]).reshape(hi - lo, -1)
            w2 = (eye[:, None, :] * w2_all[lo:hi].astype(x.dtype)[:, :, None]).reshape(-1, hi - lo)
            h = (x @ (V[:, lo:hi] @ w1) if fold_V else inner[..., lo:hi] @ w1) \
                + b1_all[lo:hi].reshape(-1)
            outs.append(jax.nn.gelu(h) @ w2 + b2_all[lo:hi])
        return jnp.concatenate(outs, axis=-1).astype(jnp.float32)


class SharedMLP(eqx.Module):
    """One MLP per site, d_in → hidden → C."""

    weights: list[Float[Array, "fan_in fan_out"]]
    biases: list[Float[Array, " fan_out"]]

    @staticmethod
    def init(key: PRNGKeyArray, C: int, d_in: int, hidden: list[int]) -> SharedMLP:
        dims = [d_in, *hidden, C]
        ws = _init_layers(key, [(a, b) for a, b in itertools.pairwise(dims)])
        return SharedMLP(ws, [jnp.zeros((b,), jnp.float32) for b in dims[1:]])

    def __call__(self, x: Float[Array, "*pos d_in"], V: Array) -> Float[Array, "*pos C"]:
        del V
        h = x
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = (jax.nn.gelu(h) if i else h) @ w.astype(h.dtype) + b
        return h.astype(jnp.float32)


class CIFunction(eqx.Module):
    """Site inputs of a batch → logits [*pos, C] for each site: one network per site, or
    one global network over all sites (`global_transformer`)."""

    sites: dict[str, ComponentwiseMLP | SharedMLP]
    global_net: GlobalCITransformer | None = None

    @staticmethod
    def init(key: PRNGKeyArray, layers: LayersConfig, d_in: Mapping[str, int],
             C: Mapping[str, int], layout: Groups | None = None) -> CIFunction:
        """`layout`: the components' groups (the global network stacks its heads by them)."""
        return CI_FNS[layers.ci_fn](key, layers, d_in, C, layout)

    def __call__(self, site_inputs: Mapping[str, Array], components: Components
                 ) -> dict[str, Float[Array, "*pos C"]]:
        if self.global_net is not None:
            return self.global_net(site_inputs, components)
        return {s: net(site_inputs[s], components.sites[s].V) for s, net in self.sites.items()}

    # The same logits one site at a time, from features computed once: a step that streams
    # its CI (`memory.stream_ci`) recomputes a site's logits where they are used instead of
    # keeping every site's [*pos, C] logits for the whole step.

    def features(self, inputs: Mapping[str, Array], components: Components,
                 remat: bool = False) -> Any:
        """What every site's logits are computed from, given the site inputs stacked by the
        components' groups: the global network's final hidden state [*pos, d_model]
        (`remat`: its blocks rematerialized), or each site's input."""
        if self.global_net is not None:
            return self.global_net.hidden(inputs, remat)
        return components.layout.unstack(inputs)

    def logits_of(self, features: Any, live: Mapping[str, tuple[int, ...]],
                  components: Components) -> dict[str, Float[Array, "n *pos C"]]:
        """The logits of each group's members `live[g]` (the components' groups), stacked."""
        if self.global_net is not None:
            return self.global_net.logits_of(features, live)
        layout = components.layout
        per_site = {s: self.sites[s](features[s], c.V)
                    for s, c in layout.unstack(components.groups, live).items()}
        return layout.stack(per_site, live)

    def per_group(self, features: Any, live: Mapping[str, tuple[int, ...]],
                  components: Components, fn: Callable[[Array], Any]) -> dict[str, Any]:
        """fn(logits of s) for each live member s of each group, stacked by group, one
        site's logits at a time and rematerialized (the backward recomputes them). The global
        network's members of a group run under one `lax.map` over their stacked heads:
        traced once however many."""
        net = self.global_net
        if net is not None:
            return {g: jax.lax.map(jax.checkpoint(
                lambda head: fn(net.head_logits(features, head))), net.heads(g, ix))
                for g, ix in live.items()}
        layout = components.layout
        out = {s: jax.checkpoint(lambda s=s, c=c: fn(self.sites[s](features[s], c.V)))()
               for s, c in layout.unstack(components.groups, live).items()}
        return layout.stack(out, live)


def _per_site(net: Callable[..., ComponentwiseMLP | SharedMLP]) -> Callable[..., CIFunction]:
    """A CI function of one `net(key, C, d_in, hidden)` per site."""
    def init(key: PRNGKeyArray, layers: LayersConfig, d_in: Mapping[str, int],
             C: Mapping[str, int], layout: Groups | None = None) -> CIFunction:
        del layout  # one network per site
        keys = jax.random.split(key, len(C))
        return CIFunction({s: net(k, C[s], d_in[s], list(layers.ci_hidden))
                           for k, s in zip(keys, C, strict=True)})
    return init


def _global(key: PRNGKeyArray, layers: LayersConfig, d_in: Mapping[str, int],
            C: Mapping[str, int], layout: Groups | None = None) -> CIFunction:
    return CIFunction({}, GlobalCITransformer.init(
        key, d_in, C, layers.ci_d_model, layers.ci_blocks, layers.ci_heads, layers.ci_mlp,
        layout))


# The CI functions by name (`layers.ci_fn`): (key, layers config, d_in and C per site) ->
# the initialised function. `mlp` feeds component c its inner activation, `vector_mlp` the
# whole site input; `shared_mlp` is one network per site over all its components;
# `global_transformer` one network over all sites.
CI_FNS: dict[str, Callable[..., CIFunction]] = {
    "mlp": _per_site(lambda k, c, d, h: ComponentwiseMLP.init(k, c, d, h, on_inner_acts=True)),
    "vector_mlp": _per_site(lambda k, c, d, h: ComponentwiseMLP.init(k, c, d, h,
                                                                     on_inner_acts=False)),
    "shared_mlp": _per_site(SharedMLP.init),
    "global_transformer": _global,
}

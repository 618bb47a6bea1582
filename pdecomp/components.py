"""Components of each site (V, U), and the per-site linear functions a target calls.

A target never knows it is being decomposed: at every site it calls `linear(site, x, W)`.
`frozen_linear` is plain inference; `recording_linear` captures site inputs for the CI
function; `masked_linear` runs the live sites through their masked components.

The last two are `SiteLinear`s: the arrays each site reads (`data[site]`) apart from one
pure rule (`apply`), so a target whose layers repeat can stack the data of a run of layers
and run them under one `lax.scan` instead of tracing each layer's sites anew.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Bool, Float, PRNGKeyArray

LinearFn = Callable[[str, Array, Array], Array]


def dot(x: Array, w: Float[Array, "k n"], operand: Any = None) -> Array:
    """x @ w in x's dtype; with `operand`, both cast to it first and the product summed and
    returned in x's dtype, and so the two matmuls of its backward (bfloat16 operands of a
    float32 step: XLA:CPU ran a SmolLM2 layer's [1024, 576] x [576, 1536] at 1.3 TFLOP/s,
    against 0.23 in float32)."""
    if operand is None or jnp.dtype(operand) == x.dtype:
        return x @ w.astype(x.dtype)
    return _narrow_dot(jnp.dtype(operand), x.dtype, w.dtype)(x, w)


@functools.cache
def _narrow_dot(operand: Any, x_dtype: Any, w_dtype: Any) -> Callable[[Array, Array], Array]:
    """`dot` with `operand` operands, forward and backward. Left to autodiff, the backward's
    matmuls would take the float32 cotangent against a narrow operand, at float32's rate;
    here the cotangent is narrowed too (as the forward's operands are), and each gradient
    is summed in its input's dtype. Only the gradients asked for are computed (a frozen
    weight's is not), from the narrow operands kept for them: half the bytes."""

    def fwd(x: Any, w: Any) -> tuple[Array, tuple[Array | None, Array | None]]:
        xo, wo = x.value.astype(operand), w.value.astype(operand)
        y = jnp.matmul(xo, wo, preferred_element_type=x_dtype)
        return y, (xo if w.perturbed else None, wo if x.perturbed else None)

    def bwd(res: tuple[Array | None, Array | None], g: Any) -> tuple[Array | None, ...]:
        xo, wo = res
        if isinstance(g, SymbolicZero):
            return None, None
        go = g.astype(operand)
        batch = tuple(range(go.ndim - 1))  # every axis of x but its last
        return (None if wo is None else jnp.matmul(go, wo.T, preferred_element_type=x_dtype),
                None if xo is None else jax.lax.dot_general(
                    xo, go, ((batch, batch), ((), ())), preferred_element_type=w_dtype))

    f = jax.custom_vjp(lambda x, w: jnp.matmul(x.astype(operand), w.astype(operand),
                                               preferred_element_type=x_dtype))
    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def einsum(spec: str, a: Array, b: Array, operand: Any = None) -> Array:
    """`dot`'s rule for a contraction written as an einsum (attention's two); its backward's
    matmuls return `operand` gradients, cast back to the inputs' dtypes."""
    if operand is None or jnp.dtype(operand) == a.dtype:
        return jnp.einsum(spec, a, b)
    return _narrow_einsum(spec, jnp.dtype(operand), a.dtype, b.dtype)(a, b)


@functools.cache
def _narrow_einsum(spec: str, operand: Any, a_dtype: Any, b_dtype: Any
                   ) -> Callable[[Array, Array], Array]:
    def fwd(a: Any, b: Any) -> tuple[Array, tuple[Any, ...]]:
        ao, bo = a.value.astype(operand), b.value.astype(operand)
        y = jnp.einsum(spec, ao, bo, preferred_element_type=a_dtype)
        # which gradients are asked for, as the residuals' structure (() yes, None no)
        return y, (ao, bo, () if a.perturbed else None, () if b.perturbed else None)

    def bwd(res: tuple[Any, ...], g: Any) -> tuple[Array | None, ...]:
        ao, bo, need_a, need_b = res
        need_a, need_b = need_a is not None, need_b is not None
        if isinstance(g, SymbolicZero):
            return None, None
        go = g.astype(operand)
        # transposes of the einsum, linear in each operand (a vjp would trace its value too)
        da = jax.linear_transpose(lambda a: jnp.einsum(spec, a, bo), ao)(go)[0] if need_a \
            else None
        db = jax.linear_transpose(lambda b: jnp.einsum(spec, ao, b), bo)(go)[0] if need_b \
            else None
        return (None if da is None else da.astype(a_dtype),
                None if db is None else db.astype(b_dtype))

    f = jax.custom_vjp(lambda a, b: jnp.einsum(spec, a.astype(operand), b.astype(operand),
                                               preferred_element_type=a_dtype))
    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f


def frozen_linear(site: str, x: Array, W: Array) -> Array:
    del site
    return dot(x, W)


@dataclass(frozen=True)
class SiteLinear:
    """A linear fn as data and one rule: site s computes `apply(data[s], x, W, operand)`; a site
    without data runs frozen. With `record`, the sites in `data` also store their input
    there (filled while tracing). A caller that runs several layers under one scan stacks
    their sites' `data` and calls `apply` in the body (llama.Llama.run_layers)."""

    data: Mapping[str, Any]
    apply: Callable[[Any, Array, Array, Any], Array]  # (data, x, W, operand)
    record: dict[str, Array] | None = None
    operand: Any = None  # the matmuls' operand dtype (`dot`); the forward's `split` sets it

    def __call__(self, site: str, x: Array, W: Array) -> Array:
        if site not in self.data:
            return dot(x, W, self.operand)
        if self.record is not None:
            self.record[site] = x
        return self.apply(self.data[site], x, W, self.operand)


def recording_linear(record: dict[str, Array], sites: Iterable[str]) -> SiteLinear:
    """A frozen linear that also stores the input of each of `sites` in `record`."""
    return SiteLinear(dict.fromkeys(sites, ()), lambda _, x, W, op: dot(x, W, op), record)


class SiteComponents(eqx.Module):
    """C rank-one components of one site's weight W [d_in, d_out]: component c is V[:, c] ⊗ U[c]."""

    V: Float[Array, "d_in C"]
    U: Float[Array, "C d_out"]

    @staticmethod
    def init(key: PRNGKeyArray, d_in: int, d_out: int, C: int) -> SiteComponents:
        kv, ku = jax.random.split(key)
        V = jax.random.normal(kv, (d_in, C), jnp.float32) / jnp.sqrt(d_in)
        U = jax.random.normal(ku, (C, d_out), jnp.float32) / jnp.sqrt(C)
        return SiteComponents(V, U)

    @property
    def weight(self) -> Float[Array, "d_in d_out"]:
        return self.V @ self.U


class Components(eqx.Module):
    """All sites' components, keyed by site name (sites may differ in shape and C)."""

    sites: dict[str, SiteComponents]

    @staticmethod
    def init(key: PRNGKeyArray, shapes: Mapping[str, tuple[int, int]],
             C: Mapping[str, int]) -> Components:
        keys = jax.random.split(key, len(C))
        return Components({s: SiteComponents.init(k, *shapes[s], C[s])
                           for k, s in zip(keys, C, strict=True)})


def with_tied(components: Components, tied: Mapping[str, str]) -> Components:
    """All sites' components: each follower site gets its leader's transpose (V=Uᵀ, U=Vᵀ),
    so gradients from both sites reach the one set of parameters. A follower already
    present is kept as it is: with a per-site tied update (`train.optimized_components`) it
    is an input of its own, with its own gradient."""
    sites = dict(components.sites)
    for follower, leader in tied.items():
        if leader in sites and follower not in sites:
            lead = sites[leader]
            sites[follower] = SiteComponents(lead.U.T, lead.V.T)
    return Components(sites)


def fold_tied(updates: Components, tied: Mapping[str, str]) -> Components:
    """Updates (or gradients) per site → the owned sites': each follower's lands on its
    leader, transposed back. Without followers (a shared tied update) nothing changes."""
    sites = {s: c for s, c in updates.sites.items() if s not in tied}
    for follower, leader in tied.items():
        if follower in updates.sites:
            f, lead = updates.sites[follower], sites[leader]
            sites[leader] = SiteComponents(lead.V + f.U.T, lead.U + f.V.T)
    return Components(sites)


class SiteMask(NamedTuple):
    """How one live site runs in one forward. Shapes lead with the site input's positions."""

    mask: Float[Array, "*pos C"]
    delta_mask: Float[Array, "*pos"] | None  # None: no delta channel
    routed: Bool[Array, "*pos"] | None  # None: routed everywhere


def weight_deltas(weights: Mapping[str, Array], components: Components) -> dict[str, Array]:
    """Δ = W − V@U per site, fp32 (faithfulness)."""
    return {s: weights[s].astype(jnp.float32) - c.weight for s, c in components.sites.items()}


def masked_linear(components: Components, site_masks: Mapping[str, SiteMask]) -> LinearFn:
    """The linear fn of a forward whose live sites are the keys of `site_masks`.

    A live site computes `((x @ V) * mask) @ U + (x @ Δ) * delta_mask` with Δ = W − V@U,
    and the frozen `x @ W` where it is not routed. Every other site stays on the frozen
    path, so it creates no [*, C] tensors and gives its V/U no gradient.
    """
    return SiteLinear({s: (components.sites[s], m) for s, m in site_masks.items()}, _masked)


def _masked(data: tuple[SiteComponents, SiteMask], x: Array, W: Array, op: Any) -> Array:
    comp, m = data
    dt = x.dtype
    # Tags for remat policies: the [*pos, C] inner acts and the site output.
    inner = checkpoint_name(dot(x, comp.V, op), "site_inner")
    if m.delta_mask is None and m.routed is None:
        return checkpoint_name(dot(inner * m.mask.astype(dt), comp.U, op), "site_out")
    # x @ Δ = x @ W − (x @ V) @ U, so the delta channel is `x @ W` (the frozen product,
    # also what an unrouted position reads) and a second mask on the same inner acts:
    # y = ((x @ V) * (mask − delta_mask)) @ U + (x @ W) * delta_mask. The same function
    # with no x @ Δ: the backward has no [d_in, d_out] weight gradient per forward (nor
    # the transposed [*pos, d_out] copy XLA:CPU made to feed it) and the step holds no Δ.
    frozen = dot(x, W, op)
    mask = m.mask if m.delta_mask is None else m.mask - m.delta_mask[..., None]
    y = dot(inner * mask.astype(dt), comp.U, op)
    if m.delta_mask is not None:
        y = y + frozen * m.delta_mask[..., None].astype(dt)
    if m.routed is not None:
        y = jnp.where(m.routed[..., None], y, frozen)
    return checkpoint_name(y, "site_out")

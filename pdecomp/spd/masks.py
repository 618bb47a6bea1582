"""Mask sources, routing samplers and recon plans.

A recon plan is a static tuple of forwards; each forward names its live sites. A source
gives each channel a value in [0, 1]; the mask interpolates between CI and 1 with it, and
the delta channel's mask is the raw source.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from pdecomp.core import threefry
from pdecomp.spd.components import Groups, MaskParts, SiteMask, mask_of, take

Plan = tuple[tuple[str, ...], ...]


# The recon plans by name (`loss.recon.<term>.plan`): (sites, sites_per_chunk) -> the
# forwards. `all`: one forward with every site; `layerwise`: one per site; `chunkwise`:
# sequential chunks of `sites_per_chunk` sites (the last chunk may be shorter).
PLANS: dict[str, Callable[[tuple[str, ...], int], Plan]] = {
    "all": lambda sites, k: (sites,),
    "layerwise": lambda sites, k: tuple((s,) for s in sites),
    "chunkwise": lambda sites, k: tuple(sites[i:i + k] for i in range(0, len(sites), k)),
}


def make_plan(kind: str, sites: Sequence[str], sites_per_chunk: int = 0) -> Plan:
    return PLANS[kind](tuple(sites), sites_per_chunk)


class Positions(eqx.Module):
    """Where the positions of a (micro)batch sit in the step's whole batch: the row-major
    index of each in the whole batch's positions, and how many the whole batch has. Random
    draws are indexed by it, so a microbatch draws exactly its rows of the whole draw."""

    index: Array  # uint32 [*pos]
    total: int = eqx.field(static=True)

    @staticmethod
    def whole(pos: tuple[int, ...]) -> Positions:
        n = math.prod(pos)
        return Positions(jax.lax.iota(jnp.uint32, n).reshape(pos), n)

    @staticmethod
    def microbatch(pos: tuple[int, ...], n_micro: int, m: Array | int) -> Positions:
        """Microbatch `m` of `n_micro`, of a batch with positions `pos` ([B] or [B, T]):
        examples m, m + n, m + 2n, ... (strided, so each device's rows split evenly)."""
        b = pos[0] // n_micro
        rest = math.prod(pos[1:])
        ex = jax.lax.iota(jnp.uint32, b) * np.uint32(n_micro) + jnp.asarray(m, jnp.uint32)
        within = jax.lax.iota(jnp.uint32, rest).reshape(pos[1:])
        index = ex.reshape((b,) + (1,) * (len(pos) - 1)) * np.uint32(rest) + within
        return Positions(index, math.prod(pos))


def _uniform(key: PRNGKeyArray, shape: tuple[int, ...], at: Positions | None) -> Array:
    """U[0, 1) of `shape` = [*pos, width]; with `at`, the rows of the whole batch's draw."""
    if at is None and math.prod(shape) < 2**32:
        return threefry.uniform(key, shape)
    at = at or Positions.whole(shape[:-1])
    return threefry.uniform_rows(key, at.index, shape[-1], at.total)


# The mask sources by name (`loss.recon.<term>.source`): (key, shape, positions) -> values
# per channel (the last channel is the delta channel).
SOURCES: dict[str, Callable[[PRNGKeyArray, tuple[int, ...], Positions | None], Array]] = {
    "continuous": lambda key, shape, at: _uniform(key, shape, at),
    "binomial": lambda key, shape, at: (_uniform(key, shape, at) < 0.5).astype(jnp.float32),
    # deterministic: mask = ci_lower, delta channel off
    "ci": lambda key, shape, at: jnp.zeros(shape, jnp.float32),
}


def sample_source(key: PRNGKeyArray, kind: str, shape: tuple[int, ...],
                  at: Positions | None = None) -> Float[Array, "*pos C1"]:
    return SOURCES[kind](key, shape, at)


def sample_routing(key: PRNGKeyArray, kind: str, live: Sequence[str], pos: tuple[int, ...],
                   at: Positions | None = None) -> dict[str, Bool[Array, "*pos"] | None]:
    """Which live sites each position routes through its masks (None: all of them)."""
    routed = ROUTINGS[kind](key, len(live), pos, at)
    return {s: None if routed is None else routed[..., i] for i, s in enumerate(live)}


def _route_uniform_k(key: PRNGKeyArray, n: int, pos: tuple[int, ...], at: Positions | None
                     ) -> Bool[Array, "*pos n"] | None:
    """Per position draw k ~ U{1..n}, route a uniform k-subset of the n live sites."""
    if n == 1:
        return None
    k_key, perm_key = jax.random.split(key)
    at = at or Positions.whole(pos)
    k = 1 + jnp.minimum(_uniform(k_key, (*pos, 1), at)[..., 0] * n, n - 1).astype(jnp.int32)
    # A random rank per site (argsort of uniforms) picks a uniform subset of size k.
    ranks = jnp.argsort(jnp.argsort(_uniform(perm_key, (*pos, n), at), axis=-1), axis=-1)
    # Materialised once: fused into its consumers, XLA:CPU recomputed the draws above for
    # every channel each site's routing broadcasts to (C times the draws: in the SmolLM2
    # step, the transposes of the masks' backward did).
    return jax.lax.optimization_barrier(ranks < k[..., None])


# The routings by name (`loss.recon.<term>.routing`): (key, live sites, positions, where)
# -> [*pos, n] whether each position routes each live site (None: all, everywhere). `all`
# routes every live site everywhere.
ROUTINGS: dict[str, Callable[[PRNGKeyArray, int, tuple[int, ...], Positions | None],
                             Array | None]] = {
    "all": lambda key, n, pos, at: None,
    "uniform_k": _route_uniform_k,
}


def masks_from_sources(ci_lower: Mapping[str, Float[Array, "*pos C"]],
                       sources: Mapping[str, Float[Array, "*pos C1"]],
                       routed: Mapping[str, Bool[Array, "*pos"] | None],
                       delta: bool) -> dict[str, SiteMask]:
    """mask = ci + (1 − ci)·source on the C channels; the delta mask is the raw source. Per
    site, or per group with every array stacked over the group's members."""
    return {s: mask_of(MaskParts(ci_lower[s], src, routed[s]), delta)
            for s, src in sources.items()}


def sample_forward_masks(key: PRNGKeyArray, live: Sequence[str], source: str, routing: str,
                         ci_lower: Mapping[str, Array], delta: bool,
                         at: Positions | None = None) -> dict[str, SiteMask]:
    """Fresh sources and routing for one forward of a plan (`at`: where these positions sit
    in the whole batch, for a microbatch), per site: `group_parts` with the sites of one
    shape stacked (the same draws)."""
    live = tuple(live)
    layout = Groups.of(live, lambda s: ci_lower[s].shape)
    lower = layout.stack(dict(ci_lower), layout.live(live))
    parts = group_parts(key, live, layout, source, routing, lower, at)
    return layout.unstack({g: mask_of(p, delta) for g, p in parts.items()})


def group_parts(key: PRNGKeyArray, live: Sequence[str], layout: Groups, source: str,
                routing: str, ci_lower: Mapping[str, Array], at: Positions | None = None
                ) -> dict[str, MaskParts]:
    """A forward's fresh sources and routing, each group's stacked over its live members,
    beside their CI: its masks' parts (`components.mask_of`). Site i of `live` draws with the
    i-th key whatever its group; a group's draws run under one vmap, traced (and compiled)
    once however many members it has."""
    live = tuple(live)
    r_key, *s_keys = jax.random.split(key, len(live) + 1)
    column = {s: i for i, s in enumerate(live)}
    members = {g: [layout.of_group(g)[i] for i in ix] for g, ix in layout.live(live).items()}
    sources = {}
    for g, ss in members.items():
        shape = (*ci_lower[g].shape[1:-1], ci_lower[g].shape[-1] + 1)
        keys = jnp.stack([s_keys[column[s]] for s in ss])
        sources[g] = jax.vmap(lambda k, shape=shape: sample_source(k, source, shape, at))(keys)
    pos = next(iter(ci_lower.values())).shape[1:-1]
    table = ROUTINGS[routing](r_key, len(live), pos, at)
    return {g: MaskParts(ci_lower[g], sources[g], None if table is None else jnp.moveaxis(
        take(table, tuple(column[s] for s in ss), len(live), axis=-1), -1, 0))
        for g, ss in members.items()}


# An adversary's source shapes by scope (`loss.pgd.scope`, `loss.eval_pgd.scope`), named for
# what one source is shared by: (positions, C) -> shape. shared: one source for the whole
# batch and every position ([1, 1, C+1]: the published fresh adversary, which shares on
# purpose, as a per-token one can exploit uncorrelated interference noise); per_position:
# one per position, shared by the batch's examples; per_token: one per example and position.
PGD_SCOPES: dict[str, Callable[[tuple[int, ...], int], tuple[int, ...]]] = {
    "shared": lambda pos, C: (*(1 for _ in pos), C + 1),
    "per_position": lambda pos, C: (1, *pos[1:], C + 1),
    "per_token": lambda pos, C: (*pos, C + 1),
}
# The names these scopes had in run directories written before they were named for what
# they share ("batch_shared" was one per position, not one for the batch).
OLD_SCOPE_NAMES = {"global": "shared", "batch_shared": "per_position",
                   "per_example": "per_token"}


def pgd_source_shape(scope: str, pos: tuple[int, ...], C: int) -> tuple[int, ...]:
    return PGD_SCOPES[scope](pos, C)

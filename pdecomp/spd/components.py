"""Components of each site (V, U), and the per-site linear functions a target calls.

A target never knows it is being decomposed: at every site it calls `linear(site, x, W)`.
`frozen_linear` is plain inference; `recording_linear` captures site inputs for the CI
function; `masked_linear` runs the live sites through their masked components.

The last two are `SiteLinear`s: the arrays each site reads (`data[site]`) apart from one
pure rule (`apply`), so a target whose layers repeat can stack the data of a run of layers
and run them under one `lax.scan` instead of tracing each layer's sites anew.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
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


def group_name(site: str) -> str:
    """The stack a site joins: its name with its first numeric part (its layer) as `*`
    (`layers.18.mlp.gate_proj` -> `layers.*.mlp.gate_proj`); a name with none is its own."""
    parts = site.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join([*parts[:i], "*", *parts[i + 1:]])
    return site


@dataclass(frozen=True)
class Groups:
    """The decomposed sites stacked by kind: each group's sites (the same name but for the
    layer, the same shape and C) in the order given; the state holds one array per group with
    a leading member axis, so the step traces each kind once however many layers hold it."""

    members: tuple[tuple[str, tuple[str, ...]], ...]
    order: tuple[str, ...]  # every site, in the order given (that of `Components.sites`)

    @staticmethod
    def of(sites: Sequence[str], same: Callable[[str], Any] = lambda s: (),
           alone: Iterable[str] = ()) -> Groups:
        """`sites` grouped by `group_name` where `same(site)` (shape, C) agrees across the
        group; a group that would mix two is split into its sites, and so are `alone`."""
        alone = set(alone)
        by: dict[str, list[str]] = {}
        for s in sites:
            by.setdefault(s if s in alone else group_name(s), []).append(s)
        out: list[tuple[str, tuple[str, ...]]] = []
        for g, ss in by.items():
            if len({repr(same(s)) for s in ss}) == 1:
                out.append((g, tuple(ss)))
            else:
                out.extend((s, (s,)) for s in ss)
        return Groups(tuple(out), tuple(sites))

    @functools.cached_property
    def index(self) -> dict[str, tuple[str, int]]:
        """site -> (its group, its place in the group)."""
        return {s: (g, i) for g, ss in self.members for i, s in enumerate(ss)}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g for g, _ in self.members)

    def of_group(self, g: str) -> tuple[str, ...]:
        return dict(self.members)[g]

    def with_group(self, g: str, sites: tuple[str, ...]) -> Groups:
        return Groups((*((h, ss) for h, ss in self.members if h != g), (g, sites)),
                      (*(s for s in self.order if s not in sites), *sites))

    def without(self, g: str) -> Groups:
        gone = set(self.of_group(g))
        return Groups(tuple((h, ss) for h, ss in self.members if h != g),
                      tuple(s for s in self.order if s not in gone))

    def live(self, sites: Iterable[str]) -> dict[str, tuple[int, ...]]:
        """The members of each group among `sites`: group -> their places, in order."""
        out: dict[str, list[int]] = {}
        for s in sites:
            g, i = self.index[s]
            out.setdefault(g, []).append(i)
        return {g: tuple(sorted(ix)) for g, ix in out.items()}

    def stack(self, per_site: Mapping[str, Any], live: Mapping[str, tuple[int, ...]] | None
              = None) -> dict[str, Any]:
        """Per-site trees -> per-group trees stacked on a new leading axis (of `live`'s
        members where given)."""
        if live is None:
            live = {g: tuple(range(len(ss))) for g, ss in self.members}
        return {g: jax.tree.map(lambda *a: jnp.stack(a), *[
            per_site[self.of_group(g)[i]] for i in ix]) for g, ix in live.items()}

    def unstack(self, per_group: Mapping[str, Any],
                live: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
        """The inverse of `stack`: each member's slice, keyed by its site (in `order`)."""
        out = {}
        for g, tree in per_group.items():
            ix = live[g] if live is not None else range(len(self.of_group(g)))
            out |= {self.of_group(g)[i]: jax.tree.map(lambda a, k=k: a[k], tree)
                    for k, i in enumerate(ix)}
        return {s: out[s] for s in self.order if s in out}


def take(tree: Any, ix: tuple[int, ...], n: int, axis: int = 0) -> Any:
    """Members `ix` (along `axis`) of a stacked tree of `n`: the tree itself when all, a
    slice when they run in order (no gather), a gather otherwise."""
    if ix == tuple(range(n)):
        return tree
    if ix == tuple(range(ix[0], ix[0] + len(ix))):
        return jax.tree.map(lambda a: jax.lax.slice_in_dim(a, ix[0], ix[0] + len(ix),
                                                           axis=axis), tree)
    return jax.tree.map(lambda a: jnp.take(a, jnp.asarray(ix), axis=axis), tree)


@dataclass(frozen=True)
class SiteLinear:
    """A linear fn as data and one rule: site s, member k of group g (`where[s]`), computes
    `apply(data[g][k], x, W, operand)`; a site without data runs frozen. Each group's data is
    stacked over its members, so a caller that runs several layers under one scan feeds a
    group's data to the scan as it is (llama.Llama.run_layers). With `record`, the sites in
    `where` also store their input there (filled while tracing)."""

    data: Mapping[str, Any]  # group -> its members' data, stacked
    where: Mapping[str, tuple[str, int]]  # site -> (group, member)
    apply: Callable[[Any, Array, Array, Any], Array]  # (data, x, W, operand)
    record: Recorded | None = None
    operand: Any = None  # the matmuls' operand dtype (`dot`); the forward's `split` sets it

    def __call__(self, site: str, x: Array, W: Array) -> Array:
        if site not in self.where:
            return dot(x, W, self.operand)
        if self.record is not None:
            self.record[site] = x
        g, k = self.where[site]
        return self.apply(jax.tree.map(lambda a: a[k], self.data[g]), x, W, self.operand)


class Recorded(dict):
    """What a forward records by key (a site's input, the residual entering a layer): one
    value at a time (`rec[key] = x`), or a scanned run's at once (`put_run(keys, stacked)`:
    no slice per layer traced); `rec[key]` reads either, and `stack(keys)` gives the run
    whole when it holds exactly `keys`. A pytree, so a step carries it like a dict."""

    def __init__(self, items: Mapping[Any, Array] = (), runs: Sequence[tuple[tuple, Array]]
                 = ()):
        super().__init__(items)
        self.runs = list(runs)

    def put_run(self, keys: tuple, stacked: Array) -> None:
        self.runs.append((tuple(keys), stacked))

    def __missing__(self, key: Any) -> Array:
        for keys, x in self.runs:
            if key in keys:
                return x[keys.index(key)]
        raise KeyError(key)

    def __contains__(self, key: Any) -> bool:
        return dict.__contains__(self, key) or any(key in keys for keys, _ in self.runs)

    def __bool__(self) -> bool:
        return dict.__len__(self) > 0 or bool(self.runs)

    def stack(self, keys: Sequence[Any]) -> Array:
        keys = tuple(keys)
        for ks, x in self.runs:
            if ks == keys:
                return x
        return jnp.stack([self[k] for k in keys])


jax.tree_util.register_pytree_node(
    Recorded,
    lambda r: ((dict(r), [x for _, x in r.runs]), tuple(ks for ks, _ in r.runs)),
    lambda run_keys, children: Recorded(children[0], list(zip(run_keys, children[1]))))


def recording_linear(record: Recorded, sites: Iterable[str]) -> SiteLinear:
    """A frozen linear that also stores the input of each of `sites` in `record`."""
    layout = Groups.of(tuple(sites))
    return SiteLinear({g: () for g in layout.names}, layout.index,
                      lambda _, x, W, op: dot(x, W, op), record)


class SiteComponents(eqx.Module):
    """C rank-one components of one site's weight W [d_in, d_out]: component c is V[:, c] ⊗ U[c].
    In `Components`, a group's: V [n, d_in, C] and U [n, C, d_out], one per member."""

    V: Float[Array, "*n d_in C"]
    U: Float[Array, "*n C d_out"]

    @staticmethod
    def init(key: PRNGKeyArray, d_in: int, d_out: int, C: int) -> SiteComponents:
        kv, ku = jax.random.split(key)
        V = jax.random.normal(kv, (d_in, C), jnp.float32) / jnp.sqrt(d_in)
        U = jax.random.normal(ku, (C, d_out), jnp.float32) / jnp.sqrt(C)
        return SiteComponents(V, U)

    @property
    def weight(self) -> Float[Array, "*n d_in d_out"]:
        return self.V @ self.U


class Components(eqx.Module):
    """All sites' components, stacked by group (`Groups`): `groups[g]` holds its members'
    V and U on a leading axis. `sites` gives each site's own (slices of the stacks)."""

    groups: dict[str, SiteComponents]
    layout: Groups = eqx.field(static=True)

    @staticmethod
    def init(key: PRNGKeyArray, shapes: Mapping[str, tuple[int, int]],
             C: Mapping[str, int], layout: Groups | None = None) -> Components:
        layout = layout or Groups.of(tuple(C), lambda s: (shapes[s], C[s]))
        keys = dict(zip(C, jax.random.split(key, len(C)), strict=True))
        return Components.of_sites({s: SiteComponents.init(keys[s], *shapes[s], C[s])
                                    for s in C}, layout)

    @staticmethod
    def of_sites(sites: Mapping[str, SiteComponents], layout: Groups | None = None
                 ) -> Components:
        """Per-site components stacked into `layout`'s groups (by default every site alone
        but for those that share a kind, shape and C)."""
        layout = layout or Groups.of(tuple(sites), lambda s: (sites[s].V.shape,
                                                              sites[s].U.shape))
        return Components(layout.stack(sites), layout)

    @property
    def sites(self) -> dict[str, SiteComponents]:
        return self.layout.unstack(self.groups)

    @property
    def site_C(self) -> dict[str, int]:
        """Each site's number of components (read from shapes: abstract trees too)."""
        C = {s: c.V.shape[-1] for g, c in self.groups.items() for s in self.layout.of_group(g)}
        return {s: C[s] for s in self.layout.order}


def with_tied(components: Components, tied: Mapping[str, str]) -> Components:
    """All sites' components: each follower site gets its leader's transpose (V=Uᵀ, U=Vᵀ),
    so gradients from both sites reach the one set of parameters. A follower already
    present is kept as it is: with a per-site tied update (`train.optimized_components`) it
    is an input of its own, with its own gradient. Tied sites are groups of their own."""
    groups, layout = dict(components.groups), components.layout
    for follower, leader in tied.items():
        if leader in groups and follower not in groups:
            lead = groups[leader]
            groups[follower] = SiteComponents(jnp.swapaxes(lead.U, -1, -2),
                                              jnp.swapaxes(lead.V, -1, -2))
            layout = layout.with_group(follower, (follower,))
    return Components(groups, layout)


def fold_tied(updates: Components, tied: Mapping[str, str]) -> Components:
    """Updates (or gradients) per site → the owned sites': each follower's lands on its
    leader, transposed back. Without followers (a shared tied update) nothing changes."""
    groups = {g: c for g, c in updates.groups.items() if g not in tied}
    layout = updates.layout
    for follower, leader in tied.items():
        if follower in updates.groups:
            f, lead = updates.groups[follower], groups[leader]
            groups[leader] = SiteComponents(lead.V + jnp.swapaxes(f.U, -1, -2),
                                            lead.U + jnp.swapaxes(f.V, -1, -2))
            layout = layout.without(follower)
    return Components(groups, layout)


class SiteMask(NamedTuple):
    """How one live site runs in one forward. Shapes lead with the site input's positions
    (in a group's stacked masks, with the member axis before them)."""

    mask: Float[Array, "*pos C"]
    delta_mask: Float[Array, "*pos"] | None  # None: no delta channel
    routed: Bool[Array, "*pos"] | None  # None: routed everywhere


def weight_stacks(weights: Mapping[str, Array], layout: Groups
                  ) -> dict[str, tuple[Array, Array]]:
    """Each group's weights as `faithfulness_into` reads them, from per-site `weights`: a
    stack of the members' (a copy: for targets too small for it to matter)."""
    return {g: (jnp.stack([weights[s] for s in ss]), jnp.arange(len(ss)))
            for g, ss in layout.members}


class MaskParts(NamedTuple):
    """What a live site's mask is made of (`mask_of`): its CI, its source (broadcasting
    against it, with the delta channel last) and where it is routed."""

    ci: Float[Array, "*pos C"]
    source: Float[Array, "*pos C1"]
    routed: Bool[Array, "*pos"] | None


def mask_of(parts: MaskParts, delta: bool) -> SiteMask:
    """mask = ci + (1 − ci)·source on the C channels; the delta mask is the raw source."""
    ci, src, routed = parts
    C = ci.shape[-1]
    return SiteMask(ci + (1.0 - ci) * src[..., :C], src[..., C] if delta else None, routed)


def faithfulness_into(stacks: Mapping[str, tuple[Array, Array]], components: Components,
                      acc: Components, scale: float | Array) -> tuple[Array, Components]:
    """Σ ‖W − V@U‖²_F over every site, and `acc` + scale · the sum's
    gradient in each V and U. Each group's members one at a time under a loop that adds to
    `acc` in place: one [d_in, d_out] delta alive, no gradient of its own beside `acc`
    (autodiff of the same sum held a whole second set of component gradients). W is read in
    place from `stacks[g]` = (a stack of weights, the row of each member)."""
    total, out = jnp.zeros((), jnp.float32), {}
    for g, c in components.groups.items():
        W, rows = stacks[g]

        def body(k, carry, W=W, rows=rows, c=c):
            sq, gV, gU = carry
            w = jax.lax.dynamic_index_in_dim(W, rows[k], keepdims=False).astype(jnp.float32)
            V, U = c.V[k], c.U[k]
            d = w - V @ U  # d‖d‖²/dV = −2 d Uᵀ, d‖d‖²/dU = −2 Vᵀ d
            gV = gV.at[k].add((-2 * scale) * (d @ U.T))
            gU = gU.at[k].add((-2 * scale) * (V.T @ d))
            return sq + jnp.sum(d * d), gV, gU

        sq, gV, gU = jax.lax.fori_loop(0, c.V.shape[0], body,
                                       (jnp.zeros((), jnp.float32), acc.groups[g].V,
                                        acc.groups[g].U))
        total, out[g] = total + sq, SiteComponents(gV, gU)
    return total, Components(out, acc.layout)


def masked_linear(components: Components, site_masks: Mapping[str, SiteMask]) -> LinearFn:
    """The linear fn of a forward whose live sites are the keys of `site_masks` (`grouped`
    for masks already stacked by group).

    A live site computes `((x @ V) * mask) @ U + (x @ Δ) * delta_mask` with Δ = W − V@U,
    and the frozen `x @ W` where it is not routed. Every other site stays on the frozen
    path, so it creates no [*, C] tensors and gives its V/U no gradient.
    """
    live = components.layout.live(site_masks)
    return grouped(components, components.layout.stack(site_masks, live), live)


def grouped(components: Components, masks: Mapping[str, SiteMask],
            live: Mapping[str, tuple[int, ...]]) -> SiteLinear:
    """`masked_linear` with each group's masks stacked over its live members `live[g]`."""
    layout = components.layout
    data = {g: (take(components.groups[g], ix, len(layout.of_group(g))), masks[g])
            for g, ix in live.items()}
    where = {layout.of_group(g)[i]: (g, k) for g, ix in live.items() for k, i in enumerate(ix)}
    return SiteLinear(data, where, _masked)


def from_parts(components: Components, parts: Mapping[str, MaskParts],
               live: Mapping[str, tuple[int, ...]], delta: bool) -> SiteLinear:
    """`grouped` with each site's mask made where the site runs (inside a scanned layer) from
    its parts, stacked by group: a group's [n, *pos, C] masks never exist whole."""
    linear = grouped(components, parts, live)
    return dataclasses.replace(linear, apply=functools.partial(_masked_from, delta=delta))


def _masked_from(data: tuple[SiteComponents, MaskParts], x: Array, W: Array, op: Any,
                 delta: bool) -> Array:
    comp, parts = data
    return _masked((comp, mask_of(parts, delta)), x, W, op)


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

"""What an analysis gathers per component, in one pass over the data on the run's devices.

Per batch, one compiled step (`step_fn`) computes each site's CI and reduces it per
component: the CI's sum, firing count (CI > threshold) and max, a histogram of CI, the top
positions by CI logit and a reservoir of positions drawn uniformly among those where it
fires (each with the component's signed activation (x . V_c) ||U_c|| and its CI along the
window), and the co-firing counts of the components of one layer. The host merges the
batches (`Harvest`): the top and reservoir by their rank, and (language models) counts
of the input token and the next token at every firing position.

The reservoir is bottom-k sampling: every firing position gets a uniform key and the k
largest keys seen are kept, so the kept positions are a uniform sample of all the firing
positions of the pass, whatever the batch order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from pdecomp.core import documents
from pdecomp.spd import losses, metrics
from pdecomp.spd.ci import ci_lower
from pdecomp.spd.components import SiteMask, masked_linear

# CI histogram bins [e_i, e_i+1), the last one closed at 1
HIST_EDGES = np.array([0.0, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0])


@dataclass(frozen=True)
class Options:
    threshold: float  # a component fires where its CI exceeds this
    top_k: int = 0  # top positions by CI logit per component (sequences only)
    reservoir: int = 0  # uniformly drawn firing positions per component (sequences only)
    groups: tuple[tuple[str, ...], ...] = ()  # sites whose components' co-firing is counted
    token_stats: bool = False  # bring each batch's firing positions back (input tokens)
    ablation: bool = False  # each component's first-order CE effect where it fires (LMs)


def layer_groups(sites: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """The sites of one layer together (`layers.N.` in the name: a SwiGLU's gate, up and
    down, an attention's q, k, v, o); a model without layers (a toy) is one group."""
    groups: dict[str, list[str]] = {}
    for s in sites:
        m = re.match(r"(.*?layers\.\d+)\.", s)
        groups.setdefault(m.group(1) if m else "", []).append(s)
    return tuple(tuple(g) for g in groups.values())


def signed_activation(x: Array, V: Array, U: Array) -> Array:
    """(x . V_c) ||U_c|| per position and component: how much, and in which direction, the
    component writes where it is read, [positions, C]."""
    inner = x.reshape(-1, x.shape[-1]).astype(jnp.float32) @ V.astype(jnp.float32)
    return inner * jnp.linalg.norm(U.astype(jnp.float32), axis=1)


def histogram(flat: Array) -> Array:
    """Counts of CI per HIST_EDGES bin, [C, bins], from one comparison per edge (no
    [positions, C, bins] one-hot)."""
    n = flat.shape[0]
    inner = [(flat >= e).sum(0) for e in HIST_EDGES[1:-1]]
    cum = jnp.stack([jnp.full(flat.shape[1], n), *inner, jnp.zeros(flat.shape[1], int)])
    return (cum[:-1] - cum[1:]).T


def _ranked(rank: Array, flat: Array, act: Array, v: Array, k: int) -> tuple[Array, ...]:
    """The k positions of largest `rank` per component: (rank, flat position, CI, signed
    activation, CI along the position's row [C, k, T])."""
    val, idx = jax.lax.top_k(rank.T, min(k, flat.shape[0]))  # [C, k]
    ci = jnp.take_along_axis(flat.T, idx, axis=1)
    a = jnp.take_along_axis(act.T, idx, axis=1)
    along = jax.vmap(lambda m, r: m[r])(jnp.moveaxis(v, -1, 0), idx // v.shape[1])
    return val, idx, ci, a, along


def site_reduce(logit: Array, x: Array, V: Array, U: Array, key: Array, o: Options
                ) -> tuple[dict[str, Any], Array]:
    """One site's batch reduced per component, and its firing mask [positions, C]."""
    v = ci_lower(logit)
    flat = v.reshape(-1, v.shape[-1])
    fired = flat > o.threshold
    out: dict[str, Any] = {"sum": flat.sum(0), "fired": fired.sum(0), "max": flat.max(0),
                           "hist": histogram(flat)}
    if o.top_k or o.reservoir:
        act = signed_activation(x, V, U)
        if o.top_k:  # ranked by the logit: where CI saturates at 1 it still tells apart
            out["top"] = _ranked(logit.reshape(flat.shape), flat, act, v, o.top_k)
        if o.reservoir:
            u = jax.random.uniform(key, flat.shape)
            out["reservoir"] = _ranked(jnp.where(fired, u, -1.0), flat, act, v, o.reservoir)
    if o.token_stats:
        out["mask"] = jnp.packbits(fired, axis=1)
    return out, fired


def cofire_counts(fired: Sequence[Array]) -> Array:
    """How often each pair of the group's components fires at the same position,
    [sum C, sum C] (the diagonal: how often each fires)."""
    # float32 at full precision: exact counts up to 2^24 a batch, on every backend (bf16
    # operands are emulated, slowly, on CPUs; TF32 would round counts past 2^11)
    m = jnp.concatenate(fired, axis=1).astype(jnp.float32)
    return jnp.einsum("nc,nd->cd", m, m, precision=jax.lax.Precision.HIGHEST).astype(jnp.int32)


def masked_ce(f: metrics.SiteForward, components: Any, x: Array, masks: dict[str, Array]
              ) -> Array:
    """The CE summed over the batch's predicted positions, every site live with its mask in
    `masks` and the delta channel on (all masks 1: the target's own output)."""
    logits = f.suffix(f.resid, masked_linear(components, {
        s: SiteMask(m, jnp.ones(m.shape[:-1]), None) for s, m in masks.items()}))
    return losses.cross_entropy(logits, documents.ids(x)) * x.shape[0] * (x.shape[1] - 1)


def ablation_gradients(f: metrics.SiteForward, components: Any, x: Array
                       ) -> dict[str, Array]:
    """d(the CE summed over the batch's predicted positions) / d(mask of each component at
    each position), at the unmasked forward (every mask 1, the delta channel on: the
    target's own output), [positions, C] per site. Ablating c where it fires changes the CE
    by about -sum of these over its firing positions (first order; one backward pass for
    all components, where exact ablation would take one forward each)."""
    grads = jax.grad(lambda m: masked_ce(f, components, x, m))(
        {s: jnp.ones(f.logits[s].shape) for s in f.inputs})
    return {s: g.reshape(-1, g.shape[-1]) for s, g in grads.items()}


def step_fn(o: Options) -> Callable:
    """(target, components, ci_fn, x, key, cofire) -> (per-site reductions, cofire + this
    batch's co-firing counts per group): the analysis's one step, jit-able."""

    def step(target: Any, components: Any, ci_fn: Any, x: Array, key: Array,
             cofire: tuple[Array, ...]) -> tuple[dict[str, Any], tuple[Array, ...]]:
        f = metrics.site_forward(target, components, ci_fn, x)  # the prefix runs once
        keys = dict(zip(f.logits, jax.random.split(key, len(f.logits))))
        out, fired = {}, {}
        for s, logit in f.logits.items():
            c = components.sites[s]
            out[s], fired[s] = site_reduce(logit, f.inputs[s], c.V, c.U, keys[s], o)
        cofire = tuple(acc + cofire_counts([fired[s] for s in g])
                       for acc, g in zip(cofire, o.groups))
        if o.ablation:
            for s, g in ablation_gradients(f, components, x).items():  # -sum of the gradient over the firing positions
                out[s]["ablation"] = -jnp.where(fired[s], g, 0.0).sum(0)
        return out, cofire

    return step


def cofire_shapes(o: Options, C: dict[str, int]) -> tuple[tuple[int, int], ...]:
    return tuple((sum(C[s] for s in g),) * 2 for g in o.groups)



def partners(cofire: Array, m: int) -> tuple[Array, Array]:
    """Per component of a group, the m others most often firing with it: P(d fires | c
    fires) = co[c, d] / co[c, c], and d (an index into the group's components)."""
    co = cofire.astype(jnp.float32)
    p = co / jnp.maximum(jnp.diagonal(co), 1.0)[:, None]
    p = jnp.where(jnp.eye(co.shape[0], dtype=bool), -1.0, p)
    return jax.lax.top_k(p, min(m, co.shape[0] - 1))


# -- the host side: batches merged ----------------------------------------------------------

Ranked = tuple[np.ndarray, ...]  # (rank, flat position, CI, signed activation, CI along row)


def merge_ranked(old: Ranked | None, new: Sequence[Any], offset: int, k: int) -> Ranked:
    """The running k best per component, merged with a batch's (its positions offset)."""
    arrays = [np.asarray(a) for a in new]
    arrays[1] = arrays[1].astype(np.int64) + offset
    if old is not None:
        arrays = [np.concatenate([o, n], axis=1) for o, n in zip(old, arrays)]
    order = np.argsort(-arrays[0], axis=1, kind="stable")[:, :k]
    return tuple(np.take_along_axis(a, order.reshape(order.shape + (1,) * (a.ndim - 2)), 1)
                 for a in arrays)


class PairCounts:
    """Counts of (component, token) pairs, kept sparse: the pairs seen, not C x vocab."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.keys = np.empty(0, np.int64)
        self.counts = np.empty(0, np.int64)
        self._pending: list[np.ndarray] = []
        self._size = 0

    def add(self, component: np.ndarray, token: np.ndarray) -> None:
        self._pending.append(component.astype(np.int64) * self.vocab + token)
        self._size += len(component)
        if self._size > 1 << 24:
            self.compact()

    def __getstate__(self) -> dict[str, Any]:  # a saved pass keeps the merged pairs only
        self.compact()
        return self.__dict__

    def compact(self) -> None:
        if not self._pending:
            return
        keys = np.concatenate([self.keys, *self._pending])
        weights = np.concatenate([self.counts, np.ones(self._size, np.int64)])
        self.keys, inverse = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inverse, weights=weights).astype(np.int64)
        self._pending, self._size = [], 0

    def top(self, m: int, score: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
            | None = None, min_count: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The m best pairs of each component by `score(component, token, count)` (default:
        the count), pairs seen fewer than `min_count` times left out: (component, token,
        count), grouped by component."""
        self.compact()
        comp, tok = np.divmod(self.keys, self.vocab)
        keep = self.counts >= min_count
        comp, tok, count = comp[keep], tok[keep], self.counts[keep]
        s = count if score is None else score(comp, tok, count)
        order = np.lexsort((-s, comp))
        comp, tok, count = comp[order], tok[order], count[order]
        first = np.searchsorted(comp, comp, side="left")
        best = np.arange(len(comp)) - first < m
        return comp[best], tok[best], count[best]


@dataclass(frozen=True)
class TokenRow:
    """A token where a component fires (or that follows it): how often, the fraction of
    the component's firings it is (precision), the fraction of its own occurrences the
    component fires on (recall), and log(P(token | fires) / P(token)) (PMI)."""

    token: int
    count: int
    precision: float
    recall: float
    pmi: float


class TokenStats:
    """Per component, the tokens at its firing positions (input) and right after them
    (next), against how often each token occurs in the analysed windows."""

    PMI_MIN_COUNT = 3  # a pair seen once or twice has a large, meaningless PMI

    def __init__(self, vocab: int, C: int):
        self.C = C
        self.pairs = {"input": PairCounts(vocab), "next": PairCounts(vocab)}
        self.fired = {k: np.zeros(C, np.int64) for k in self.pairs}
        self.totals = {k: np.zeros(vocab, np.int64) for k in self.pairs}

    def add(self, packed_mask: np.ndarray, ids: np.ndarray) -> None:
        """One batch: its firing mask (np.packbits along C) over its token windows."""
        T = ids.shape[1]
        pos, comp = np.nonzero(np.unpackbits(packed_mask, axis=1, count=self.C))
        flat = ids.reshape(-1).astype(np.int64)
        has_next = pos % T < T - 1
        for kind, (c, tok, seen) in {
                "input": (comp, flat[pos], flat),
                "next": (comp[has_next], flat[pos[has_next] + 1], ids[:, 1:].reshape(-1))
        }.items():
            self.pairs[kind].add(c, tok)
            self.fired[kind] += np.bincount(c, minlength=self.C)
            self.totals[kind] += np.bincount(seen, minlength=len(self.totals[kind]))

    def rows(self, kind: str, m: int, by: str = "count") -> list[list[TokenRow]]:
        """Each component's m tokens of `kind` (input, next), by count or by PMI."""
        fired, totals = self.fired[kind], self.totals[kind]
        n = max(int(totals.sum()), 1)

        def pmi(c: np.ndarray, t: np.ndarray, k: np.ndarray) -> np.ndarray:
            return np.log(k / np.maximum(fired[c], 1) / (np.maximum(totals[t], 1) / n))

        comp, tok, count = self.pairs[kind].top(
            m, pmi if by == "pmi" else None, self.PMI_MIN_COUNT if by == "pmi" else 1)
        out: list[list[TokenRow]] = [[] for _ in range(self.C)]
        for c, t, k, p in zip(comp, tok, count, pmi(comp, tok, count)):
            out[c].append(TokenRow(int(t), int(k), k / fired[c], k / totals[t], float(p)))
        return out


@dataclass
class SiteHarvest:
    """One site's components over the batches merged so far."""

    C: int
    options: Options
    vocab: int = 0  # a language model's: its token statistics are kept
    positions: int = 0
    sum: np.ndarray | None = None
    fired: np.ndarray | None = None
    max: np.ndarray | None = None
    hist: np.ndarray | None = None
    ablation: np.ndarray | None = None  # summed first-order CE change, [C]
    top: Ranked | None = None
    reservoir: Ranked | None = None
    tokens: TokenStats | None = None

    def add(self, out: dict[str, Any], positions: int, ids: np.ndarray | None) -> None:
        """A batch's reductions (`positions` of them); `ids`: its token windows."""
        o, offset = self.options, self.positions
        new = {k: np.asarray(out[k]) for k in ("sum", "fired", "max", "hist")}
        if self.sum is None:
            self.sum, self.fired, self.max, self.hist = (
                np.zeros(self.C), np.zeros(self.C, np.int64), np.full(self.C, -np.inf),
                np.zeros((self.C, len(HIST_EDGES) - 1), np.int64))
        self.sum = self.sum + new["sum"]
        self.fired = self.fired + new["fired"]
        self.max = np.maximum(self.max, new["max"])
        self.hist = self.hist + new["hist"]
        if "top" in out:
            self.top = merge_ranked(self.top, out["top"], offset, o.top_k)
        if "reservoir" in out:
            self.reservoir = merge_ranked(self.reservoir, out["reservoir"], offset,
                                          o.reservoir)
        if "ablation" in out:
            self.ablation = (0 if self.ablation is None else self.ablation) + np.asarray(
                out["ablation"], np.float64)
        if "mask" in out and ids is not None:
            self.tokens = self.tokens or TokenStats(self.vocab, self.C)
            self.tokens.add(np.asarray(out["mask"]), ids)
        self.positions += positions

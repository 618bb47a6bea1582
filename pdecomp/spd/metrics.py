"""Evaluation metrics every kind shares: CI, L0 and live components per site, and the
masked forwards' CE/KL by mask kind (fresh PGD among them). A kind's own (a toy's
ground-truth match) live with its kind."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding
from jaxtyping import Array

from pdecomp.core import documents
from pdecomp.core.config import EvalPGDConfig
from pdecomp.core.memory import PLAIN, MemoryPolicy
from pdecomp.spd import losses
from pdecomp.spd.adversary import Adversary, ascend
from pdecomp.spd.ci import ci_lower
from pdecomp.spd.components import (
    Components,
    Recorded,
    SiteMask,
    masked_linear,
    recording_linear,
)
from pdecomp.spd.masks import masks_from_sources, pgd_source_shape, sample_forward_masks


def causal_importances(target, components: Components, ci_fn, x: Array) -> dict[str, Array]:
    """ci_lower per site for inputs x (the masks' CI)."""
    return {s: ci_lower(v) for s, v in ci_logits(target, components, ci_fn, x).items()}


def ci_logits(target, components: Components, ci_fn, x: Array) -> dict[str, Array]:
    """The CI function's logits per site for inputs x, before the clamp to [0, 1]."""
    return site_forward(target, components, ci_fn, x).logits


class SiteForward(NamedTuple):
    """A clean forward read at the sites: the rest of the model after the first site's
    layer (`suffix`) and its input (`resid`, for a masked forward to start from), each
    site's input, and the CI function's logits."""

    suffix: Callable
    resid: Array
    inputs: dict[str, Array]
    logits: dict[str, Array]


def site_forward(target, components: Components, ci_fn, x: Array) -> SiteForward:
    record = Recorded()
    prefix, suffix = target.split(tuple(components.sites), PLAIN)
    resid = prefix(x)
    suffix(resid, recording_linear(record, components.sites))
    inputs = {s: record[s] for s in components.sites}
    return SiteForward(suffix, resid, inputs, ci_fn(inputs, components))


MASK_KINDS = ("ci", "unmasked", "stochastic", "random", "rounded", "zero")
EVAL_KINDS = (*MASK_KINDS, "pgd")  # pgd: the fresh adversary, when loss.eval_pgd has steps


def eval_masks(kind: str, lower: dict[str, Array], key: Array, threshold: float,
               delta: bool) -> dict[str, SiteMask]:
    """Every site live and routed, with the masks of `kind`: ci (the CI itself), unmasked
    (all 1), stochastic (a continuous source, as in training), random (U[0,1], ignoring CI),
    rounded (CI > threshold), zero (all 0). Only `stochastic` samples the delta channel;
    the others leave it off, so they show what the components alone compute."""
    if kind == "stochastic":
        return sample_forward_masks(key, tuple(lower), "continuous", "all", lower, delta)
    keys = dict(zip(lower, jax.random.split(key, len(lower))))
    make = {"ci": lambda s, v: v, "unmasked": lambda s, v: jnp.ones_like(v),
            "random": lambda s, v: jax.random.uniform(keys[s], v.shape),
            "rounded": lambda s, v: (v > threshold).astype(v.dtype),
            "zero": lambda s, v: jnp.zeros_like(v)}[kind]
    off = (lambda v: jnp.zeros(v.shape[:-1], v.dtype)) if delta else (lambda v: None)
    return {s: SiteMask(make(s, v), off(v), None) for s, v in lower.items()}


def fresh_pgd_masks(distance: Callable[[dict[str, SiteMask]], Array],
                    lower: dict[str, Array], key: Array, delta: bool, pgd: EvalPGDConfig
                    ) -> dict[str, SiteMask]:
    """Every site live and routed, masked by sources drawn uniformly (one per component
    and `pgd.scope`) and then pushed by `pgd.n_steps` sign ascents of `distance` (clamped
    to [0, 1] after each): the masks of an adversary that starts from nothing, unlike
    training's persistent one."""
    return pgd_trajectory(distance, lower, key, delta, pgd, (pgd.n_steps,))[0]


def pgd_trajectory(distance: Callable[[dict[str, SiteMask]], Array],
                   lower: dict[str, Array], key: Array, delta: bool, pgd: EvalPGDConfig,
                   marks: Sequence[int]) -> list[dict[str, SiteMask]]:
    """The masks of one fresh adversary (`fresh_pgd_masks`) after each of `marks` ascents
    (ascending): the adversary of `n_steps = m` for every mark m, in one ascent."""
    keys = dict(zip(lower, jax.random.split(key, len(lower))))
    sources = {s: jax.random.uniform(keys[s], pgd_source_shape(pgd.scope, v.shape[:-1],
                                                               v.shape[-1]))
               for s, v in lower.items()}
    routed = {s: None for s in lower}

    def ascent(_, adv):
        grads = jax.grad(lambda src: distance(masks_from_sources(lower, src, routed, delta)))(
            adv.sources)
        return ascend(adv, grads, pgd.step_size, "sign")  # sign steps keep no optimizer state

    adv, done, out = Adversary(sources, None), 0, []
    for mark in marks:
        adv = jax.lax.fori_loop(done, mark, ascent, adv)
        done = mark
        out.append(masks_from_sources(lower, adv.sources, routed, delta))
    return out


def lm_pgd_curve(target, components: Components, ci_fn, batches: Sequence[Array], key: Array,
                 delta: bool, dtype, pgd: EvalPGDConfig, marks: Sequence[int],
                 chunk: int = 0) -> dict[int, float]:
    """KL to the target of the forward masked by a fresh adversary after each of `marks`
    ascents (`pgd_trajectory`), mean over the batches: how fast an adversary that starts
    from nothing breaks the decomposition, as VPD reports it."""
    sites, marks = tuple(components.sites), tuple(marks)

    @jax.jit
    def one(target, components, ci_fn, tokens, key):
        prefix, suffix = target.split(sites, MemoryPolicy(compute_dtype=dtype))
        resid = prefix(tokens)
        record = Recorded()
        clean_lp = losses.recon_target("kl", suffix(resid, recording_linear(record, sites)),
                                       chunk)
        lower = {s: ci_lower(v) for s, v in ci_fn({s: record[s] for s in sites},
                                                  components).items()}

        def kl(m):
            return losses.kl(suffix(resid, masked_linear(components, m)), clean_lp, chunk)

        return jnp.stack([kl(m) for m in pgd_trajectory(kl, lower, key, delta, pgd, marks)])

    total = sum(np.asarray(one(target, components, ci_fn, t, jax.random.fold_in(key, i)))
                for i, t in enumerate(batches))
    return {m: float(v) / len(batches) for m, v in zip(marks, total)}


def lm_mask_metrics(one: Callable, target, components: Components, ci_fn,
                    batches: Sequence[Array], key: Array, pgd: EvalPGDConfig
                    ) -> dict[str, float | None]:
    """CE of the target, and CE and KL (to the target) of the forward with every site
    masked by each of MASK_KINDS, and by a fresh adversary (`pgd`, kind "pgd", when it has
    steps), mean over the batches of `one` (`mask_metrics_program`); ce_unrecovered per
    kind = (CE_masked − CE_target) / (CE_zero − CE_target): 0 is the target, 1 is no better
    than ablating every site."""
    kinds = EVAL_KINDS if pgd.n_steps else MASK_KINDS
    totals: dict[str, float | None] = {}
    for i, tokens in enumerate(batches):
        for k, v in one(target, components, ci_fn, tokens, jax.random.fold_in(key, i)).items():
            totals[k] = totals.get(k, 0.0) + float(v) / len(batches)
    # Undefined (None) where ablating every site does not lose CE against the target, as
    # on text the target does not model (no scale to measure recovery on).
    gap = totals["ce/zero"] - totals["ce/target"]
    for kind in kinds:
        totals[f"ce_unrecovered/{kind}"] = ((totals[f"ce/{kind}"] - totals["ce/target"]) / gap
                                            if gap > 1e-6 else None)
    return totals


def mask_metrics_program(sites: tuple[str, ...], threshold: float, delta: bool, dtype,
                         pgd: EvalPGDConfig, chunk: int = 0) -> Callable:
    """The jitted program of `lm_mask_metrics` for one batch: (target, components, ci_fn,
    tokens, key) -> {"ce/<kind>", "kl/<kind>": scalar}."""

    @jax.jit  # the model and its components are arguments, not constants of the program
    def one(target, components, ci_fn, tokens, key):
        prefix, suffix = target.split(sites, MemoryPolicy(compute_dtype=dtype))
        resid = prefix(tokens)
        record = Recorded()
        clean = suffix(resid, recording_linear(record, sites))
        logits = ci_fn({s: record[s] for s in sites}, components)
        lower = {s: ci_lower(v) for s, v in logits.items()}
        clean_lp = losses.recon_target("kl", clean, chunk)
        ids = documents.ids(tokens)
        # The target's CE from the KL's log-probs: one log-softmax over the vocabulary, not two
        out = {"ce/target": losses.next_token_nll(
            jax.tree.map(lambda a: a[:, :-1], clean_lp), ids)}
        # One masked forward at a time (lax.map over the kinds' stacked masks): unrolled,
        # XLA keeps every kind's vocabulary-sized logits alive at once, several times the
        # training step's peak at LM sizes.
        keys = jax.random.split(key, len(MASK_KINDS))
        stacked = jax.tree.map(lambda *m: jnp.stack(m), *(
            eval_masks(kind, lower, k, threshold, delta) for kind, k in zip(MASK_KINDS, keys)))

        def ce_kl(masks):
            masked = suffix(resid, masked_linear(components, masks))
            return (losses.cross_entropy(masked, ids, chunk),
                    losses.kl(masked, clean_lp, chunk))

        ce, kl = jax.lax.map(ce_kl, stacked)
        for i, kind in enumerate(MASK_KINDS):
            out[f"ce/{kind}"], out[f"kl/{kind}"] = ce[i], kl[i]
        if pgd.n_steps:
            masked = suffix(resid, masked_linear(components, fresh_pgd_masks(
                lambda m: losses.kl(suffix(resid, masked_linear(components, m)), clean_lp,
                                    chunk),
                lower, jax.random.fold_in(key, len(MASK_KINDS)), delta, pgd)))
            out["ce/pgd"] = losses.cross_entropy(masked, ids, chunk)
            out["kl/pgd"] = losses.kl(masked, clean_lp, chunk)
        return out

    return one


def ci_summary(target, components: Components, ci_fn, batches: Iterable[Array],
               threshold: float, replicated: Sharding
               ) -> dict[str, dict[str, np.ndarray | float]]:
    """Per site: max and mean CI per component over the batches, each component's firing
    density (the share of rows where its CI is above the threshold), L0 (components above
    the threshold per row; `l0_any`: above 0, as the published figures count), live components,
    and the CI values' histogram over CI_HIST_EDGES (every row and component).

    A component is live when its CI exceeds the threshold on some input. `replicated` (the
    mesh's fully replicated sharding) lets every process of a multi-process job read the
    per-component results, also when the components are split across processes.
    """
    reduce_jit = ci_summary_program(threshold, replicated)
    acc: dict[str, dict] = {}
    n = 0
    for x in batches:
        for s, (vmax, vsum, active, nonzero, hist, rows) in reduce_jit(
                target, components, ci_fn, x).items():
            vmax, vsum = np.asarray(vmax, np.float64), np.asarray(vsum, np.float64)
            a = acc.setdefault(s, {"max": np.zeros(vmax.shape), "sum": np.zeros(vmax.shape),
                                   "active": np.zeros(vmax.shape),
                                   "hist": np.zeros(len(CI_HIST_EDGES) - 1), "nonzero": 0.0})
            a["max"] = np.maximum(a["max"], vmax)
            a["sum"] += vsum
            a["active"] += np.asarray(active, np.float64)
            a["hist"] += np.asarray(hist, np.float64)
            a["nonzero"] += float(nonzero)
        n += int(rows)
    return {s: {"max_ci": a["max"], "mean_ci": a["sum"] / n, "density": a["active"] / n,
                "l0": float(a["active"].sum()) / n, "l0_any": a["nonzero"] / n,
                "ci_hist": a["hist"],
                "live": int((a["max"] > threshold).sum())} for s, a in acc.items()}


def ci_summary_program(threshold: float, replicated: Sharding) -> Callable:
    """`ci_summary`'s program for one batch: (target, components, ci_fn, x) -> per site the
    [C]-sized reductions (only those reach the host), replicated on every device."""

    def reduce(target, components, ci_fn, x):
        out = {}
        for s, v in causal_importances(target, components, ci_fn, x).items():
            v = v.reshape(-1, v.shape[-1])
            # per component: a count over every row and component could pass 2**31 at LM sizes
            hist = jnp.histogram(v, jnp.asarray(CI_HIST_EDGES, v.dtype))[0]
            out[s] = (v.max(0), v.sum(0), (v > threshold).sum(0), (v > 0).sum(), hist,
                      v.shape[0])
        return out

    return jax.jit(reduce, out_shardings=replicated)


# The CI histogram's bins: log-spaced near 0, where most of a sparse decomposition's CI lies.
CI_HIST_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)

"""Evaluation metrics: L0 and live components per site, and the toy ground-truth matches."""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from pdecomp.ci import ci_lower
from pdecomp.components import Components, recording_linear
from pdecomp.targets import TMS, ResidMLP


def causal_importances(target, components: Components, ci_fn, x: Array) -> dict[str, Array]:
    """ci_lower per site for inputs x (the masks' CI)."""
    record: dict[str, Array] = {}
    target(x, recording_linear(record))
    logits = ci_fn({s: record[s] for s in components.sites}, components)
    return {s: ci_lower(v) for s, v in logits.items()}


def ci_summary(target, components: Components, ci_fn, batches: Iterable[Array],
               threshold: float) -> dict[str, dict[str, np.ndarray | float]]:
    """Per site: max and mean CI per component over the batches, L0 and live components.

    A component is live when its CI exceeds the threshold on some input.
    """
    ci_of = jax.jit(lambda x: causal_importances(target, components, ci_fn, x))
    acc: dict[str, dict] = {}
    n = 0
    for x in batches:
        ci = ci_of(x)
        for s, v in ci.items():
            v = np.asarray(v).reshape(-1, v.shape[-1])
            a = acc.setdefault(s, {"max": np.zeros(v.shape[-1]), "sum": np.zeros(v.shape[-1]),
                                   "l0": 0.0})
            a["max"] = np.maximum(a["max"], v.max(0))
            a["sum"] += v.sum(0)
            a["l0"] += float((v > threshold).sum())
        n += v.shape[0]
    return {s: {"max_ci": a["max"], "mean_ci": a["sum"] / n, "l0": a["l0"] / n,
                "live": int((a["max"] > threshold).sum())} for s, a in acc.items()}


def _match(target_vecs: np.ndarray, comp_vecs: np.ndarray) -> tuple[float, float, np.ndarray]:
    """MMCS and ML2R of target vectors [F, d] against component vectors [F, C, d].

    For each feature f: the component with the highest cosine similarity to the target's
    vector; MMCS is the mean of those maxima, ML2R the mean norm ratio of the matches.
    Pass live components only: in a 2-d space a dead component of negligible norm can
    point along a feature by chance, and cosine similarity ignores its scale.
    """
    t_norm = np.linalg.norm(target_vecs, axis=-1)  # [F]
    c_norm = np.linalg.norm(comp_vecs, axis=-1)  # [F, C]
    cos = np.einsum("fd,fcd->fc", target_vecs, comp_vecs) / np.maximum(
        t_norm[:, None] * c_norm, 1e-12)
    best = cos.argmax(-1)
    f = np.arange(len(best))
    return float(cos[f, best].mean()), float((c_norm[f, best] / t_norm).mean()), best


def tms_ground_truth(target: TMS, components: Components,
                     live: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """MMCS/ML2R per TMS site over its live components (all when `live` is None).

    linear1's feature f writes W[f, :]; component c's counterpart is V[f, c]·U[c, :].
    linear2 reads feature f through column f of Wᵀ.
    """
    out = {}
    W = np.asarray(target.W)
    for site, comp in components.sites.items():
        V, U = np.asarray(comp.V), np.asarray(comp.U)
        if live is not None:
            keep = np.asarray(live[site], bool)
            if not keep.any():
                out[f"mmcs/{site}"], out[f"ml2r/{site}"] = 0.0, 0.0
                continue
            V, U = V[:, keep], U[keep]
        if site == "linear1":
            t, c = W, np.einsum("fc,cd->fcd", V, U)
        elif site == "linear2":
            t, c = W, np.einsum("dc,cf->fcd", V, U)
        else:
            continue
        out[f"mmcs/{site}"], out[f"ml2r/{site}"], _ = _match(t, c)
    return out


def resid_one_to_one(target: ResidMLP, components: Components, ci_fn,
                     threshold: float) -> dict[str, int]:
    """Per mlp_in site: how many features activate exactly one component that no other
    feature activates (one-hot input e_f of value 1)."""
    eye = jnp.eye(target.W_E.shape[0], dtype=jnp.float32)
    ci = causal_importances(target, components, ci_fn, eye)
    out = {}
    for site, v in ci.items():
        if not site.endswith("mlp_in"):
            continue
        active = np.asarray(v) > threshold  # [F, C]
        per_comp = active.sum(0)
        one = [(row.sum() == 1) and per_comp[row.argmax()] == 1 for row in active]
        out[f"one_to_one/{site}"] = int(np.sum(one))
    return out

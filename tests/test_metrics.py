"""Ground-truth metrics on decompositions whose answer is known."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdecomp.core.config import TMSConfig
from pdecomp.kinds.cache import init_target
from pdecomp.kinds.toy import tms_ground_truth
from pdecomp.spd.components import Components, SiteComponents


def _perfect(W: jnp.ndarray, C: int, scale: float = 1.0) -> Components:
    """Component f holds exactly feature f's row of W (times `scale`); the rest are zero."""
    n, m = W.shape
    V = jnp.zeros((n, C)).at[jnp.arange(n), jnp.arange(n)].set(1.0)
    U = jnp.zeros((C, m)).at[:n].set(W * scale)
    return Components.of_sites({"linear1": SiteComponents(V, U), "linear2": SiteComponents(U.T, V.T)})


def test_perfect_tms_decomposition_scores_one():
    t = init_target(jax.random.PRNGKey(0), TMSConfig(n_features=5, d_hidden=2))
    out = tms_ground_truth(t, _perfect(t.W, 20))
    for site in ("linear1", "linear2"):
        assert out[f"mmcs/{site}"] == pytest.approx(1.0, abs=1e-6)
        assert out[f"ml2r/{site}"] == pytest.approx(1.0, abs=1e-6)


def test_ml2r_sees_the_scale_and_mmcs_does_not():
    t = init_target(jax.random.PRNGKey(0), TMSConfig(n_features=5, d_hidden=2))
    out = tms_ground_truth(t, _perfect(t.W, 20, scale=0.5))
    assert out["mmcs/linear1"] == pytest.approx(1.0, abs=1e-6)
    assert out["ml2r/linear1"] == pytest.approx(0.5, abs=1e-6)


def test_merged_features_lower_mmcs_and_live_mask_excludes_dead_components():
    t = init_target(jax.random.PRNGKey(0), TMSConfig(n_features=5, d_hidden=2))
    comps = _perfect(t.W, 20)
    c1 = comps.sites["linear1"]
    # component 0 now carries features 0 and 1 together (feature 1's own component is dead)
    V = c1.V.at[1, 0].set(1.0).at[1, 1].set(0.0)
    U = c1.U.at[0].set(t.W[0] + t.W[1]).at[1].set(0.0)
    merged = Components.of_sites({"linear1": SiteComponents(V, U), "linear2": SiteComponents(U.T, V.T)})
    alive = np.array([i in (0, 2, 3, 4) for i in range(20)])
    out = tms_ground_truth(t, merged, {"linear1": alive, "linear2": alive})
    assert out["mmcs/linear1"] < 0.99

"""State round trips through orbax; toy targets are cached and checked for every feature."""

from __future__ import annotations

import dataclasses as dc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdecomp.core.config import RunConfig, TMSConfig
from pdecomp.gate.compiled import abstract
from pdecomp.kinds import cache as targets
from pdecomp.kinds import toy as toys
from pdecomp.plan.resolve import resolve
from pdecomp.run.checkpoint import Checkpointer
from pdecomp.spd.step import init_state, make_train_step

SMALL = TMSConfig(name="tms_small", train_steps=600, train_batch_size=512)


def test_state_round_trips_through_a_checkpoint(tmp_path):
    cfg = RunConfig(data=dc.replace(RunConfig().data, batch_size=64))
    target = targets.init_target(jax.random.PRNGKey(0), cfg.model)
    spec = resolve(cfg).step
    state = init_state(jax.random.PRNGKey(1), spec, target)
    step = jax.jit(make_train_step(spec))
    x = toys.sample_inputs(jax.random.PRNGKey(2), cfg.model, 64)
    state, _ = step(state, target, x)  # non-trivial optimizer moments and step counter
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, state)
    ck.wait()
    restored = Checkpointer(tmp_path / "ck").restore(abstract(state))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the restored state continues the same trajectory
    _s1, m1 = step(state, target, x)
    _s2, m2 = step(restored, target, x)
    assert float(m1["loss/total"]) == float(m2["loss/total"])


def test_partial_checkpoint_is_not_taken_for_complete(tmp_path):
    cfg = RunConfig()
    target = targets.init_target(jax.random.PRNGKey(0), cfg.model)
    spec = resolve(cfg).step
    state = init_state(jax.random.PRNGKey(1), spec, target)
    ck = Checkpointer(tmp_path / "ck")
    ck.save(5, state)
    ck.wait()
    # a writer killed mid-save leaves only a temporary directory behind
    (tmp_path / "ck" / "9.orbax-checkpoint-tmp").mkdir()
    assert Checkpointer(tmp_path / "ck").latest_step() == 5


def test_target_is_cached_by_its_settings(tmp_path):
    cfg = dc.replace(SMALL, cache_dir=str(tmp_path))
    logs: list[str] = []
    t1, meta1 = targets.load_or_train_target(cfg, log=logs.append)
    assert any("training target" in m for m in logs)
    logs.clear()
    t2, meta2 = targets.load_or_train_target(cfg, log=logs.append)
    assert logs == []  # loaded, not trained
    np.testing.assert_array_equal(np.asarray(t1.W), np.asarray(t2.W))
    assert meta1["check"]["ok"] and meta1 == meta2
    other = dc.replace(cfg, seed=5)
    assert targets.cache_key(other) != targets.cache_key(cfg)


def test_feature_check_finds_a_dropped_feature():
    cfg = TMSConfig()
    t = targets.init_target(jax.random.PRNGKey(0), cfg)
    t = dc.replace(t, W=jnp.ones_like(t.W).at[3].set(0.0))  # feature 3 dropped
    report = toys.TMS_KIND.check_target(t, cfg)
    assert report["missing"] == [3] and not report["ok"]


def test_target_missing_features_on_every_seed_fails_clearly(tmp_path, monkeypatch):
    cfg = dc.replace(SMALL, cache_dir=str(tmp_path), max_retrain=1)
    monkeypatch.setattr(toys.TMSKind, "check_target",
                        lambda self, t, c: {"missing": [0], "ok": False, "min_score": 0.0,
                                      "median_score": 0.0, "threshold": 0.5,
                                      "problem": "misses features [0]"})
    with pytest.raises(targets.TargetError, match="represents all 5 features"):
        targets.load_or_train_target(cfg, log=lambda s: None)
    assert not list(tmp_path.rglob("target.eqx"))  # nothing half-made left in the cache

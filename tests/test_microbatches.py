"""Gradient accumulation (`optim.microbatches`): the step over n microbatches is the
whole-batch step, imp-min's log term over the whole batch and the PGD ascents included."""

from __future__ import annotations

import dataclasses as dc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gate_report
from test_lm import tiny_cfg, tokens

from pdecomp.core.config import ConfigError, OptGroupConfig, RunConfig
from pdecomp.kinds import cache as targets
from pdecomp.kinds import toy as toys
from pdecomp.plan.resolve import resolve
from pdecomp.plan.validation import validate
from pdecomp.spd.masks import Positions, sample_forward_masks
from pdecomp.spd.step import init_state, make_train_step

# lr 1 and Adam's eps 1e-3: the first update is g / (|g| + 1e-3), smooth in the gradient, so the
# updated state compares gradients. (With eps 1e-8 the first step is sign(g), where a
# gradient element that cancels to ~0 may take either sign on any summation order.)
LINEAR_ADAM = OptGroupConfig(lr=1.0, eps=1e-3, warmup_frac=0.0, schedule="constant")


def with_microbatches(cfg: RunConfig, n: int) -> RunConfig:
    return dc.replace(cfg, optim=dc.replace(cfg.optim, microbatches=n))


def one_step(cfg: RunConfig, target, batch):
    spec = resolve(cfg).step
    state = init_state(jax.random.PRNGKey(1), spec, target)
    new, metrics = jax.jit(make_train_step(spec))(state, target, batch)
    return state, new, metrics


def assert_same_step(cfg: RunConfig, target, batch, n: int) -> None:
    old, whole, m_whole = one_step(cfg, target, batch)
    _, split, m_split = one_step(with_microbatches(cfg, n), target, batch)
    assert set(m_whole) == set(m_split)
    for k in m_whole:  # every loss term, the L0s, the gradient norm
        np.testing.assert_allclose(m_split[k], m_whole[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # the updates themselves (state - old state), leaf by leaf, against the largest update
    paths = jax.tree_util.tree_leaves_with_path(whole)
    for (path, a), b, o in zip(paths, jax.tree.leaves(split), jax.tree.leaves(old),
                               strict=True):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_array_equal(a, b)
            continue
        d_whole = np.asarray(a, np.float64) - np.asarray(o, np.float64)
        d_split = np.asarray(b, np.float64) - np.asarray(o, np.float64)
        # The adversary's ascent is Adam with eps 1e-8 (not configurable): sign-like, so its
        # sources compare against their own scale ([0, 1]), not against their update's.
        adversary = path[0].name == "adversary"
        scale = max(np.abs(a).max() if adversary else np.abs(d_whole).max(), 1e-6)
        err = np.abs(d_split - d_whole).max() / scale
        assert err <= 1e-5, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.slow  # 20 s: outside the quick tier (make test-fast)
def test_llama_tiny_step_over_microbatches_is_the_whole_batch_step():
    """Chunkwise uniform-k recon, persistent PGD (2 warmup ascents, sources shared by the
    batch, so every ascent sums all microbatches' gradients) and the global CI transformer,
    as the llama_tiny preset runs them; 4 microbatches of 2 sequences."""
    cfg = tiny_cfg(scope="per_position")
    layers = dc.replace(cfg.layers, ci_fn="global_transformer", ci_d_model=16, ci_blocks=1,
                        ci_heads=2, ci_mlp=32)
    cfg = dc.replace(cfg, layers=layers, data=dc.replace(cfg.data, batch_size=8),
                     optim=dc.replace(cfg.optim, components=LINEAR_ADAM, ci_fn=LINEAR_ADAM))
    target = targets.init_target(jax.random.PRNGKey(0), cfg.model)
    assert_same_step(cfg, target, tokens(cfg), 4)


def test_tms_step_over_microbatches_is_the_whole_batch_step():
    """TMS 5-2 as `make run` trains it (tied components, both recon plans, imp-min)."""
    base = RunConfig()
    cfg = dc.replace(base, data=dc.replace(base.data, batch_size=256),
                     optim=dc.replace(base.optim, components=LINEAR_ADAM, ci_fn=LINEAR_ADAM))
    target = targets.init_target(jax.random.PRNGKey(0), cfg.model)
    x = toys.sample_inputs(jax.random.PRNGKey(2), cfg.model, 256)
    assert_same_step(cfg, target, x, 8)


def test_a_microbatch_draws_its_rows_of_the_whole_batch_masks():
    lower = {s: jax.random.uniform(jax.random.PRNGKey(i), (8, 5, 6)) for i, s in
             enumerate("abc")}
    key = jax.random.PRNGKey(3)
    whole = sample_forward_masks(key, tuple(lower), "continuous", "uniform_k", lower, True)
    for m in range(4):
        rows = {s: v[m::4] for s, v in lower.items()}
        part = sample_forward_masks(key, tuple(lower), "continuous", "uniform_k", rows, True,
                                    Positions.microbatch((8, 5), 4, m))
        for s in lower:
            for a, b in zip(part[s], whole[s], strict=True):
                np.testing.assert_array_equal(a, b[m::4])


def test_microbatches_must_divide_the_batch_and_leave_every_device_rows():
    cfg = with_microbatches(RunConfig(), 3)  # batch 4096
    with pytest.raises(ConfigError, match="optim.microbatches"):
        validate(cfg)
    cfg = dc.replace(with_microbatches(RunConfig(), 4096),
                     mesh=dc.replace(RunConfig().mesh, data=2))
    with pytest.raises(ConfigError, match="in each of optim.microbatches=4096"):
        validate(cfg, n_devices=2)


# optim.microbatch_size: examples per data-axis device per microbatch, so a preset's
# microbatches follow the mesh it runs on.
@pytest.mark.parametrize("mesh, data_axis, microbatches", [("fsdp8x8", 8, 8), ("fsdp64", 64, 1),
                                                          ("fsdp16x8", 16, 4)])
def test_the_8b_preset_takes_its_microbatches_from_the_mesh(mesh, data_axis, microbatches):
    from launcher.api import compose
    from pdecomp.core import sharding
    from pdecomp.plan import resolve as resolve_lib

    cfg = compose(["gate.only=true", "gate.target=b200", f"mesh={mesh}"],
                  preset="llama8b_l18-26_chunkwise")
    assert cfg.optim.microbatch_size == 2 and cfg.data.batch_size == 128
    assert resolve_lib.data_axis(cfg, None) == data_axis
    assert cfg.optim.microbatches == microbatches  # 128 / (2 x data axis)
    assert sharding.microbatch_counts(cfg.data.batch_size, data_axis) == [
        m for m in range(1, 128 // data_axis + 1) if 128 // data_axis % m == 0]


def test_a_local_mesh_settles_its_microbatches_in_the_job():
    from pdecomp.plan import resolve as resolve_lib

    cfg = dc.replace(RunConfig(), optim=dc.replace(RunConfig().optim, microbatch_size=512),
                     data=dc.replace(RunConfig().data, batch_size=4096))
    assert resolve_lib.with_microbatch_size(cfg, None) == cfg  # devices not known yet
    assert resolve_lib.with_microbatch_size(cfg, 1).optim.microbatches == 8
    assert resolve_lib.with_microbatch_size(cfg, 8).optim.microbatches == 1  # 8 devices x 512
    assert resolve_lib.with_microbatch_size(cfg, 2).optim.microbatches == 4
    unset = dc.replace(cfg, optim=dc.replace(cfg.optim, microbatch_size=0))
    assert resolve_lib.with_microbatch_size(unset, 8) == unset
    # the mesh make_mesh builds is the one the count was settled for: 4 examples a device,
    # 8 in the batch, 4 devices -> 2 of them (not 4 devices of 2 examples)
    small = dc.replace(cfg, data=dc.replace(cfg.data, batch_size=8),
                       optim=dc.replace(cfg.optim, microbatch_size=4))
    assert resolve_lib.data_axis(small, 4) == 2
    assert resolve_lib.data_axis(resolve_lib.with_microbatch_size(small, 4), 4) == 2
    assert resolve(small, 4).batch == resolve_lib.BatchPlan(8, 1, 2)
    # mesh.data first, as make_mesh takes it
    both = dc.replace(cfg, mesh=dc.replace(cfg.mesh, data=2, gpus_per_host=4))
    assert resolve_lib.data_axis(both, 8) == 2


@pytest.mark.parametrize("overrides, key", [
    (["optim.microbatches=4"], "optim.microbatches"),  # both set
    (["optim.microbatch_size=3"], "optim.microbatch_size"),  # 3 x 8 does not divide 128
    (["optim.microbatch_size=-1"], "optim.microbatch_size"),
    (["gate.fit=microbatches"], "optim.microbatch_size"),  # the search would change it
    (["gate.fit=batch"], "optim.microbatch_size"),
])
def test_microbatch_size_refusals_name_the_key(overrides, key):
    from launcher.api import compose

    with pytest.raises(ConfigError) as e:
        compose(["gate.only=true", "gate.target=b200", "mesh=fsdp8x8", *overrides],
                preset="llama8b_l18-26_chunkwise")
    assert e.value.key == key, str(e.value)


def test_a_refusal_names_what_would_hold_less():
    from pdecomp.run.decompose import GateRefused

    def refused(**fields) -> str:
        return str(GateRefused(gate_report(peak_bytes=200 * 2**30, cap_bytes=160 * 2**30,
                                           fits=False, **fields)))

    hint = "up to 32 microbatches would hold fewer activations"
    assert hint in refused(microbatches=16, max_microbatches=32)
    assert "microbatches" not in refused(microbatches=32, max_microbatches=32)
    saves = "memory.site_layer_saves={} would keep fewer"
    assert saves.format("sites or nothing") in refused(site_layer_saves="linears")
    assert saves.format("nothing") in refused(site_layer_saves="sites")
    for last in ("nothing", None):  # nothing lighter, or the layers not rematerialized
        assert "site_layer_saves" not in refused(site_layer_saves=last)

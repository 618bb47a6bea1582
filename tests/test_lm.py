"""The LM half of docs/method.md on a tiny Llama: residual start, frozen path, KL, persistent
PGD (scopes, ascent, averaged gradient, 1 vs 8 devices) and the state's checkpoint round trip."""

from __future__ import annotations

import collections
import dataclasses as dc
import textwrap
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on_cpu_devices

from pdecomp.core.config import (
    DataConfig,
    EvalPGDConfig,
    LayersConfig,
    LlamaModelConfig,
    LossConfig,
    OptimConfig,
    PGDConfig,
    ReconTermConfig,
    RunConfig,
)
from pdecomp.core.memory import MemoryPolicy
from pdecomp.kinds import cache as targets
from pdecomp.plan.resolve import resolve
from pdecomp.plan.validation import validate
from pdecomp.run.checkpoint import Checkpointer
from pdecomp.spd import losses
from pdecomp.spd.adversary import ascend, fresh
from pdecomp.spd.ci import ci_lower
from pdecomp.spd.components import Recorded, masked_linear, recording_linear
from pdecomp.spd.masks import masks_from_sources, pgd_source_shape, sample_forward_masks
from pdecomp.spd.metrics import (
    fresh_pgd_masks,
    lm_mask_metrics,
    lm_pgd_curve,
    mask_metrics_program,
    pgd_trajectory,
)
from pdecomp.spd.step import init_state, make_train_step

SITES = [f"layers.{i}.mlp.{w}" for i in (1, 2) for w in ("gate_proj", "up_proj", "down_proj")]


def tiny_cfg(scope: str = "per_position", optimizer: str = "adam", **memory) -> RunConfig:
    model = LlamaModelConfig(name="llama_t", vocab_size=64, d_embed=32, n_layers=4,
                        d_mlp=48, n_heads=4, n_kv_heads=2,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8})
    loss = LossConfig(faithfulness_coeff=10.0, imp_min_coeff=1e-3, p_start=2.0, p_end=0.4,
                      beta=0.2, distance="kl",
                      recon={"chunkwise": ReconTermConfig(0.5, "chunkwise", 3, "continuous",
                                                          "uniform_k")},
                      pgd=PGDConfig(coeff=0.5, scope=scope, optimizer=optimizer, n_warmup=2))
    cfg = RunConfig(model=model, layers=LayersConfig(sites=SITES, C=8, ci_fn="shared_mlp",
                                                     tie=False),
                    loss=loss, optim=OptimConfig(steps=20, faith_warmup_steps=0),
                    data=DataConfig(batch_size=4, source="synthetic", seq_len=8))
    if memory:
        cfg = dc.replace(cfg, memory=dc.replace(cfg.memory, **memory))
    validate(cfg)
    return cfg


def tokens(cfg: RunConfig, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed),
                              (cfg.data.batch_size, cfg.data.seq_len), 0, cfg.model.vocab_size)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    target = targets.init_target(jax.random.PRNGKey(0), cfg.model)
    spec = resolve(cfg).step
    state = init_state(jax.random.PRNGKey(1), spec, target)
    return cfg, target, state


@pytest.fixture(scope="module")
def step(setup):
    """The setup's train step, compiled once for the module (a compile takes seconds)."""
    return jax.jit(make_train_step(resolve(setup[0]).step))


class Clean(NamedTuple):
    """The clean forward of one batch, as the train step sees it."""

    resid: jax.Array
    suffix: Callable
    clean_lp: jax.Array
    lower: dict
    streams: Recorded


def clean_forward(cfg: RunConfig, target, state) -> Clean:
    prefix, suffix = target.split(SITES, MemoryPolicy())
    resid = prefix(tokens(cfg))
    rec, streams = Recorded(), Recorded()
    clean_lp = losses.recon_target("kl", suffix(resid, recording_linear(rec, SITES), streams=streams))
    lower = {s: ci_lower(v) for s, v in state.ci_fn({s: rec[s] for s in SITES},
                                                    state.components).items()}
    return Clean(resid, suffix, clean_lp, lower, streams)


def pgd_distance(c: Clean, components) -> Callable:
    """sources -> D of the forward with every site live and masked by them."""

    def d(sources):
        masks = masks_from_sources(c.lower, sources, {s: None for s in sources}, True)
        return losses.kl(c.suffix(c.resid, masked_linear(components, masks)), c.clean_lp)

    return d


def test_residual_start_and_suffix_equal_the_whole_model(setup):
    cfg, target, _ = setup
    x = tokens(cfg)
    prefix, suffix = target.split(SITES, MemoryPolicy())
    np.testing.assert_allclose(suffix(prefix(x)), target(x), rtol=1e-5, atol=1e-5)
    # the prefix is layer 0 only: the first site lives in layer 1
    h0 = target.run_layers(target.embed_tokens(x), 0, 1)
    np.testing.assert_allclose(prefix(x).h, h0, rtol=1e-6)
    # sites in hooked layers see the clean forward's inputs: down sees silu(gate) * up
    rec = Recorded()
    suffix(prefix(x), recording_linear(rec, SITES))
    gate = rec["layers.1.mlp.gate_proj"] @ target.mlp["gate_proj"][1]
    up = rec["layers.1.mlp.up_proj"] @ target.mlp["up_proj"][1]
    np.testing.assert_allclose(rec["layers.1.mlp.down_proj"], jax.nn.silu(gate) * up,
                               rtol=1e-5, atol=1e-6)


def test_sites_not_live_take_the_frozen_path(setup):
    """A chunk's forward gives no V/U gradient to sites outside the chunk and makes no
    [*, C] tensor for them."""
    cfg, target, state = setup
    c = clean_forward(cfg, target, state)
    live = tuple(SITES[:3])
    masks = sample_forward_masks(jax.random.PRNGKey(3), live, "continuous", "uniform_k",
                                 c.lower, True)

    def d(components):
        return losses.kl(c.suffix(c.resid, masked_linear(components, masks)), c.clean_lp)

    grads = jax.grad(d)(state.components)
    for s in SITES:
        g = np.abs(np.asarray(grads.sites[s].V)).sum() + np.abs(np.asarray(grads.sites[s].U)).sum()
        assert (g > 0) == (s in live), s
    jaxpr = str(jax.make_jaxpr(d)(state.components))
    C = cfg.layers.C
    # the live sites' inner acts [4, 8, C] appear; a forward with no live site has none
    assert f"f32[4,8,{C}]" in jaxpr
    no_live = str(jax.make_jaxpr(lambda comps: losses.kl(
        c.suffix(c.resid, masked_linear(comps, {})), c.clean_lp))(state.components))
    assert f"f32[4,8,{C}]" not in no_live


def as_plain_function(linear: Callable) -> Callable:
    """The same linear fn as a plain function, which a target runs unrolled."""
    return lambda site, x, W: linear(site, x, W)


def test_site_layers_under_one_scan_equal_them_unrolled(setup):
    """A run of site layers whose sites read alike runs under one scan: its logits, the
    gradients in every site's components, the recorded site inputs and the
    streams equal those of the same layers unrolled (a plain linear fn is never scanned)."""
    cfg, target, state = setup
    c = clean_forward(cfg, target, state)
    masks = sample_forward_masks(jax.random.PRNGKey(3), tuple(SITES), "continuous",
                                 "uniform_k", c.lower, True)

    def d(components, unrolled):
        linear = masked_linear(components, masks)
        if unrolled:
            linear = as_plain_function(linear)
        return losses.kl(c.suffix(c.resid, linear), c.clean_lp)

    scanned = str(jax.make_jaxpr(lambda a: d(a, False))(state.components))
    assert scanned.count("scan[") > str(jax.make_jaxpr(
        lambda a: d(a, True))(state.components)).count("scan[")
    for got, want in zip(jax.value_and_grad(d)(state.components, False),
                         jax.value_and_grad(d)(state.components, True)):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)

    prefix, suffix = target.split(SITES, MemoryPolicy())
    x = tokens(cfg)
    runs = []
    for linear_of in (lambda rec: recording_linear(rec, SITES),
                      lambda rec: as_plain_function(recording_linear(rec, SITES))):
        rec, streams = Recorded(), Recorded()
        out = suffix(prefix(x), linear_of(rec), streams=streams)
        runs.append((out, {s: rec[s] for s in SITES}, {i: streams[i] for i in (1, 2)}))
    for got, want in zip(*runs):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_sites_of_one_shape_draw_their_own_keys_values():
    """A forward's sources are drawn under one vmap per shape; each site's equal its draw
    alone from its own key."""
    live = ("a", "b", "c")
    lower = {"a": jnp.zeros((2, 5, 4)), "b": jnp.zeros((2, 5, 6)), "c": jnp.zeros((2, 5, 4))}
    key = jax.random.PRNGKey(7)
    masks = sample_forward_masks(key, live, "continuous", "all", lower, True)
    _, *keys = jax.random.split(key, len(live) + 1)
    for k, s in zip(keys, live):
        alone = jax.random.uniform(k, (2, 5, lower[s].shape[-1] + 1))
        np.testing.assert_array_equal(masks[s].mask, alone[..., :-1])
        np.testing.assert_array_equal(masks[s].delta_mask, alone[..., -1])


def test_kl_is_fp32_zero_on_itself_and_matches_a_direct_sum():
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 11)).astype(jnp.bfloat16)
    clean = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 11))
    target = losses.recon_target("kl", clean)
    assert target.dtype == jnp.float32
    assert float(losses.kl(clean, target)) == pytest.approx(0.0, abs=1e-6)
    p = np.exp(np.asarray(target, np.float64))
    q = jax.nn.log_softmax(np.asarray(logits.astype(jnp.float32), np.float64), axis=-1)
    direct = np.mean(np.sum(p * (np.log(p) - np.asarray(q)), axis=-1))
    assert float(losses.kl(logits, target)) == pytest.approx(direct, rel=1e-5)
    assert losses.kl(logits, target).dtype == jnp.float32


def test_ce_from_the_kl_targets_log_probs_equals_it_from_the_logits():
    """Evaluation's `ce/target` reads the KL target's log-probs instead of taking a second
    log-softmax: the same CE, against one taken by hand in float64."""
    logits = 4 * jax.random.normal(jax.random.PRNGKey(0), (3, 7, 97))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 7), 0, 97)
    x = np.asarray(logits, np.float64)  # numpy's float64: jax would compute it in float32
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    by_hand = -np.mean(np.take_along_axis(lp[:, :-1], np.asarray(tokens)[:, 1:, None], axis=-1))
    from_target = losses.next_token_nll(losses.recon_target("kl", logits)[:, :-1], tokens)
    assert float(from_target) == pytest.approx(by_hand, rel=1e-6)
    assert float(losses.cross_entropy(logits, tokens)) == pytest.approx(by_hand, rel=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kl_and_ce_in_chunks_of_positions_equal_them_whole(dtype):
    """`memory.logits_chunk`: the target kept as its logits (their dtype) and float32
    log-normaliser, the KL, its gradient in the logits and the CE taken 2 positions of 6 at
    a time equal those of the float32 log-probs taken whole, within float32 rounding."""
    x = (4 * jax.random.normal(jax.random.PRNGKey(0), (3, 6, 1001))).astype(dtype)
    clean = (4 * jax.random.normal(jax.random.PRNGKey(1), (3, 6, 1001))).astype(dtype)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (3, 6), 0, 1001)
    whole = losses.recon_target("kl", clean)
    chunked = losses.recon_target("kl", clean, chunk=2)
    assert chunked.logits.dtype == jnp.dtype(dtype) and chunked.lse.shape == (3, 6, 1)
    (v_whole, g_whole), (v_chunked, g_chunked) = (
        jax.value_and_grad(losses.distance("kl", c))(x, t) for c, t in ((0, whole), (2, chunked)))
    assert float(v_chunked) == pytest.approx(float(v_whole), rel=1e-6)
    assert g_chunked.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(g_chunked, np.float32),
                               np.asarray(g_whole, np.float32), rtol=1e-5, atol=1e-8)
    assert float(losses.kl(clean, chunked, 2)) == pytest.approx(0.0, abs=1e-6)
    nll = [losses.next_token_nll(jax.tree.map(lambda a: a[:, :-1], t), tokens)
           for t in (whole, chunked)]
    assert float(nll[1]) == pytest.approx(float(nll[0]), rel=1e-6)
    ce = [losses.cross_entropy(x, tokens, c) for c in (0, 3)]
    assert float(ce[1]) == pytest.approx(float(ce[0]), rel=1e-6)
    # the target is a constant: no gradient flows into it
    g = jax.grad(lambda c: losses.kl(x, losses.recon_target("kl", c, 2), 2))(clean)
    assert not np.any(np.asarray(g, np.float32))


def test_kl_gradients_equal_autodiff_of_its_definition():
    """The KL's own backward (softmax(logits) − p, and the target's p (lt − log q + 1))
    against autodiff of KL = Σ p (lt − log_softmax(logits)), in both arguments."""
    logits = 4 * jax.random.normal(jax.random.PRNGKey(0), (3, 5, 97))
    target = losses.recon_target("kl", 4 * jax.random.normal(jax.random.PRNGKey(1), (3, 5, 97)))

    def written(x, lt):
        return jnp.mean(jnp.sum(jnp.exp(lt) * (lt - jax.nn.log_softmax(x, axis=-1)), axis=-1))

    for got, want in zip(jax.value_and_grad(losses.kl, argnums=(0, 1))(logits, target),
                         jax.value_and_grad(written, argnums=(0, 1))(logits, target)):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scope,shape", [("shared", (1, 1, 9)), ("per_position", (1, 8, 9)),
                                         ("per_token", (4, 8, 9))])
def test_source_scopes(scope, shape):
    assert pgd_source_shape(scope, (4, 8), 8) == shape
    cfg = tiny_cfg(scope)
    target = targets.init_target(jax.random.PRNGKey(0), cfg.model)
    spec = resolve(cfg).step
    state = init_state(jax.random.PRNGKey(1), spec, target)
    for s in SITES:
        src = state.components.layout.unstack(state.adversary.sources)[s]
        assert src.shape == shape and float(src.min()) >= 0 and float(src.max()) <= 1


def test_shared_source_gradient_is_the_average_over_what_it_is_shared_by(setup):
    """A batch-shared source's gradient is the sum of the per-example sources' gradients at
    the same point: the loss is a mean over positions, so each example contributes 1/B of it
    (the 'averaged' gradient), and no replica sees only its own shard."""
    cfg, target, state = setup
    d = pgd_distance(clean_forward(cfg, target, state), state.components)

    shared = state.components.layout.unstack(state.adversary.sources)  # [1, T, C+1] each
    expanded = {s: jnp.broadcast_to(v, (4, *v.shape[1:])) for s, v in shared.items()}
    g_shared, g_each = jax.grad(d)(shared), jax.grad(d)(expanded)
    for s in SITES:
        np.testing.assert_allclose(g_shared[s][0], g_each[s].sum(0), rtol=1e-4, atol=1e-9)
        assert float(jnp.abs(g_shared[s]).sum()) > 0


@pytest.mark.slow  # 10-25 s each: outside the quick tier (make test-fast)
@pytest.mark.parametrize("optimizer", ["adam", "sign"])
def test_ascent_increases_the_distance_and_clamps(setup, optimizer):
    cfg, target, state = setup
    d = pgd_distance(clean_forward(cfg, target, state), state.components)

    adv = fresh(state.components.layout.unstack(state.adversary.sources))  # per site
    before = float(d(adv.sources))
    for _ in range(3):
        adv = ascend(adv, jax.grad(d)(adv.sources), 0.05, optimizer)
    assert float(d(adv.sources)) > before
    big = ascend(adv, jax.grad(d)(adv.sources), 100.0, optimizer)  # clamp holds any step
    for v in big.sources.values():
        assert float(v.min()) >= 0.0 and float(v.max()) <= 1.0


@pytest.mark.slow  # 10-25 s each: outside the quick tier (make test-fast)
def test_fresh_eval_pgd_starts_anew_ascends_and_reports_ce_and_kl(setup):
    cfg, target, state = setup
    c = clean_forward(cfg, target, state)
    comps = state.components

    def kl_of(masks):
        return losses.kl(c.suffix(c.resid, masked_linear(comps, masks)), c.clean_lp)

    key = jax.random.PRNGKey(7)
    start = fresh_pgd_masks(kl_of, c.lower, key, True, EvalPGDConfig(n_steps=0))
    pushed = fresh_pgd_masks(kl_of, c.lower, key, True, EvalPGDConfig(5, 0.1))
    assert float(kl_of(pushed)) > float(kl_of(start)) > 0
    for s, m in pushed.items():  # sources clamped to [0, 1]: masks between CI and 1
        assert float((m.mask - c.lower[s]).min()) >= -1e-6 and float(m.mask.max()) <= 1 + 1e-6
        assert float(m.delta_mask.min()) >= 0 and float(m.delta_mask.max()) <= 1
    # Nothing persists: the same key gives the same adversary, whatever ran before.
    again = fresh_pgd_masks(kl_of, c.lower, key, True, EvalPGDConfig(5, 0.1))
    assert float(kl_of(again)) == float(kl_of(pushed))

    pgd = EvalPGDConfig(5, 0.1)
    one = mask_metrics_program(tuple(comps.sites), 0.1, True, jnp.float32, pgd)
    out = lm_mask_metrics(one, target, comps, state.ci_fn, [tokens(cfg)], key, pgd)
    assert out["kl/pgd"] > out["kl/stochastic"] and out["ce_unrecovered/pgd"] > 0


@pytest.mark.slow  # 10-25 s: outside the quick tier (make test-fast)
def test_a_fresh_adversary_s_trajectory_is_each_step_count_s_adversary(setup):
    """pgd_trajectory's masks after m ascents are fresh_pgd_masks' with n_steps = m (one
    ascent serves VPD's 20/40/80/160 curve); per_position sources are one per position,
    shared by the batch's examples, per_token ones are not; lm_pgd_curve reports the
    trajectory's KL, rising with the ascents."""
    cfg, target, state = setup
    c = clean_forward(cfg, target, state)
    comps = state.components

    def kl_of(masks):
        return losses.kl(c.suffix(c.resid, masked_linear(comps, masks)), c.clean_lp)

    key = jax.random.PRNGKey(3)
    for scope in ("per_position", "per_token"):
        pgd = EvalPGDConfig(6, 0.1, scope)
        path = pgd_trajectory(kl_of, c.lower, key, True, pgd, (2, 6))
        for m, masks in zip((2, 6), path):
            alone = fresh_pgd_masks(kl_of, c.lower, key, True, EvalPGDConfig(m, 0.1, scope))
            for s in masks:
                np.testing.assert_array_equal(masks[s].mask, alone[s].mask)
        shared = [bool(jnp.all(m.delta_mask == m.delta_mask[:1])) for m in path[1].values()]
        assert all(shared) == (scope == "per_position")
    curve = lm_pgd_curve(target, comps, state.ci_fn, [tokens(cfg)], key, True, jnp.float32,
                         EvalPGDConfig(8, 0.1, "per_token"), (0, 8))
    assert curve[8] > curve[0] > 0


def test_pgd_warmup_ascents_and_the_after_backward_ascent_are_counted(setup, step):
    cfg, target, state = setup
    for i in range(2):
        state, m = step(state, target, tokens(cfg, i))
    count = int(state.adversary.opt.count)  # Adam's step count: n_warmup + 1 per step
    assert count == 2 * (cfg.loss.pgd.n_warmup + 1)
    assert np.isfinite(float(m["loss/pgd"])) and float(m["loss/pgd"]) > 0


@pytest.mark.parametrize("n_warmup", [2, pytest.param(0, marks=pytest.mark.slow)])  # 0: a compile
def test_the_training_adversary_ascends(setup, step, n_warmup):
    """A train step moves the persistent sources uphill: against the components and CI the
    step started from, on its batch, the distance under the sources after the step is
    above that under the sources before (an ascent turned into a descent fails here). With
    no warm-up ascents, the one ascent after the backward alone (its own sign)."""
    cfg, target, state = setup
    if n_warmup != cfg.loss.pgd.n_warmup:
        cfg = dc.replace(cfg, loss=dc.replace(cfg.loss, pgd=dc.replace(cfg.loss.pgd,
                                                                         n_warmup=n_warmup)))
        step = jax.jit(make_train_step(resolve(cfg).step))
    for i in (1, 2):  # past the adversary's learning-rate warm-up
        state, _ = step(state, target, tokens(cfg, i))
    d = pgd_distance(clean_forward(cfg, target, state), state.components)
    unstack = state.components.layout.unstack
    before = float(d(unstack(state.adversary.sources)))
    after = float(d(unstack(step(state, target, tokens(cfg))[0].adversary.sources)))
    assert after > before * 1.001, (before, after)


def test_state_round_trip_through_a_checkpoint_continues_the_trajectory(setup, step, tmp_path):
    """Sources, their moments and the step counter are in the checkpoint: 2 steps, save,
    restore, 2 steps equals 4 steps straight."""
    cfg, target, state0 = setup
    straight = state0
    for i in range(4):
        straight, m_straight = step(straight, target, tokens(cfg, i))
    half = state0
    for i in range(2):
        half, _ = step(half, target, tokens(cfg, i))
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(2, half)
    ckpt.close()
    restored = Checkpointer(tmp_path / "ckpt").restore(jax.eval_shape(lambda: state0))
    assert int(restored.step) == 2 and int(restored.adversary.opt.count) == int(
        half.adversary.opt.count)
    for a, b in zip(jax.tree.leaves(eqx.filter(half, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(restored, eqx.is_array))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for i in range(2, 4):
        restored, m_resumed = step(restored, target, tokens(cfg, i))
    for k in m_straight:
        np.testing.assert_allclose(m_resumed[k], m_straight[k], rtol=1e-6, err_msg=k)


@pytest.mark.slow  # 10-25 s each: outside the quick tier (make test-fast)
@pytest.mark.parametrize("remat", ["full", "save_dots", "names", "offload"])  # vs none
def test_remat_policies_keep_the_numbers(setup, step, remat):
    cfg, target, state = setup
    ref = step(state, target, tokens(cfg))[1]
    spec = resolve(tiny_cfg(remat=remat, remat_names=["layer_out"])).step
    got = jax.jit(make_train_step(spec))(
        state, target, tokens(cfg))[1]
    for k in ("loss/total", "loss/recon_chunkwise", "loss/pgd"):
        assert float(got[k]) == pytest.approx(float(ref[k]), rel=1e-5), (remat, k)


@pytest.mark.slow  # 10-25 s each: outside the quick tier (make test-fast)
@pytest.mark.parametrize("saves", ["sites", "nothing"])  # linears: test_layouts' memory plans
def test_site_layer_saves_keep_the_numbers(setup, step, saves):
    """Scanned site layers rematerialized with the lighter policies give the step without
    remat."""
    cfg, target, state = setup
    ref = step(state, target, tokens(cfg))[1]
    spec = resolve(tiny_cfg(remat_layers=True, site_layer_saves=saves)).step
    got = jax.jit(make_train_step(spec))(
        state, target, tokens(cfg))[1]
    for k in ("loss/total", "loss/recon_chunkwise", "loss/pgd", "train/grad_norm/components"):
        assert float(got[k]) == pytest.approx(float(ref[k]), rel=1e-5), (saves, k)


def _dot_operands(fn, *args) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in fn's jaxpr, sub-jaxprs included."""
    out = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                out.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for v in eqn.params.values():
                for w in v if isinstance(v, tuple | list) else (v,):
                    if hasattr(getattr(w, "jaxpr", w), "eqns"):
                        walk(getattr(w, "jaxpr", w))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def test_a_step_with_the_logits_in_chunks_takes_the_same_update(setup, step):
    """memory.logits_chunk=2 (4 chunks of the 8 positions): every loss, and the updated
    components, equal the step's with the vocabulary's log-probs whole, within float32
    rounding."""
    cfg, target, state = setup
    chunked = jax.jit(make_train_step(resolve(tiny_cfg(logits_chunk=2)).step))
    (ref_state, ref), (got_state, got) = (f(state, target, tokens(cfg)) for f in (step, chunked))
    for k in ("loss/total", "loss/recon_chunkwise", "loss/pgd", "loss/faithfulness"):
        assert float(got[k]) == pytest.approx(float(ref[k]), rel=1e-5), k
    for a, b in zip(jax.tree.leaves(got_state.components), jax.tree.leaves(ref_state.components)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_matmul_dtype_runs_the_forwards_matmuls_in_it(setup, step):
    """memory.matmul_dtype=bfloat16 on a float32 step: the target's and the components'
    matmuls take bfloat16 operands (float32 products), faithfulness and the CI function
    keep float32; the losses stay within bfloat16's rounding of the float32 step's."""
    cfg, target, state = setup
    mixed = make_train_step(resolve(tiny_cfg(matmul_dtype="bfloat16")).step)
    ops = _dot_operands(mixed, state, target, tokens(cfg))
    full = _dot_operands(make_train_step(resolve(cfg).step), state, target,
                         tokens(cfg))
    assert set(full) == {("float32", "float32")}
    # Forward and backward, no dot mixes the two dtypes (a float32 cotangent against a
    # narrow operand runs at float32's rate); the float32 ones are the CI function's and
    # faithfulness's alone, a minority.
    counts = collections.Counter(ops)
    assert set(counts) == {("bfloat16", "bfloat16"), ("float32", "float32")}, counts
    assert counts["bfloat16", "bfloat16"] > 3 * counts["float32", "float32"], counts
    ref = step(state, target, tokens(cfg))[1]
    got = jax.jit(mixed)(state, target, tokens(cfg))[1]
    for k in ("loss/total", "loss/recon_chunkwise", "loss/pgd", "loss/faithfulness"):
        assert float(got[k]) == pytest.approx(float(ref[k]), rel=2e-2), k
    assert float(got["loss/faithfulness"]) == float(ref["loss/faithfulness"])


SCRIPT = textwrap.dedent("""
    import json, dataclasses as dc
    import jax, numpy as np
    from conftest import train_on_all_devices
    from test_lm import tiny_cfg, tokens
    cfg = tiny_cfg()
    cfg = dc.replace(cfg, data=dc.replace(cfg.data, batch_size=8))
    state, hist = train_on_all_devices(cfg, 0, 1, [tokens(cfg, i) for i in range(3)])
    src = {s: np.asarray(v).tolist() for s, v in state.adversary.sources.items()}
    print(json.dumps({"n": len(jax.devices()), "hist": hist, "src": src}))
""")


@pytest.mark.slow  # 10-25 s each: outside the quick tier (make test-fast)
@pytest.mark.jax_versions  # the LM step's numbers on 1 and 8 devices
def test_lm_steps_and_shared_sources_match_on_1_and_8_devices():
    one, eight = run_on_cpu_devices(SCRIPT, 1), run_on_cpu_devices(SCRIPT, 8)
    assert (one["n"], eight["n"]) == (1, 8)
    for a, b in zip(one["hist"], eight["hist"]):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert set(eight["src"]) == set(one["src"]) == {"layers.*.mlp.gate_proj",
                                                    "layers.*.mlp.up_proj",
                                                    "layers.*.mlp.down_proj"}
    for g in one["src"]:  # each group's sources, stacked over its layers
        np.testing.assert_allclose(eight["src"][g], one["src"][g], rtol=1e-4, atol=1e-5)


def test_a_chunk_forward_from_the_clean_stream_equals_the_whole_suffix(setup):
    """A forward starts at its first live layer from the clean residual there: the same
    logits as running every site layer (the earlier ones are frozen anyway)."""
    cfg, target, state = setup
    c = clean_forward(cfg, target, state)
    assert 1 in c.streams and 2 in c.streams and 0 not in c.streams  # site layers only
    live = tuple(SITES[3:])  # layer 2 only
    masks = sample_forward_masks(jax.random.PRNGKey(4), live, "continuous", "all", c.lower,
                                 True)
    linear = masked_linear(state.components, masks)
    np.testing.assert_allclose(c.suffix(c.resid, linear, streams=c.streams, live=live),
                               c.suffix(c.resid, linear), rtol=1e-5, atol=1e-5)

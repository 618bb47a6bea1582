"""The Llama family's variants, by their flags: attention biases (Llama's `attention_bias`,
Qwen2's q/k/v), sliding windows (Mistral's every layer, Qwen2's from `max_window_layers`) and
QK-norm with a head_dim of its own (Qwen3) against transformers' own classes (committed
fixtures, scripts/make_llama_fixtures.py), and the same flags on a model without a checkpoint, decomposed."""

from __future__ import annotations

import dataclasses as dc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_llama import FIXTURES, _rel_err, _variant
from test_lm import tiny_cfg, tokens

from pdecomp.core import documents
from pdecomp.core.config import ConfigError
from pdecomp.kinds import cache as targets
from pdecomp.plan.resolve import resolve
from pdecomp.plan.validation import validate
from pdecomp.spd.components import frozen_linear
from pdecomp.spd.step import init_state, make_train_step
from pdecomp.targets.hf_checkpoint import CheckpointError, load_config, load_hf

VARIANTS = ["llama_bias", "qwen2_bias", "mistral_window", "qwen2_window", "qwen3_qknorm"]


@pytest.mark.jax_versions  # the loader's variants
@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_transformers(name):
    path = FIXTURES / name
    model = load_hf(path)
    x = np.load(path / "tokens.npy")
    ref = np.load(path / "logits.npy")
    assert _rel_err(np.asarray(jax.jit(lambda m, t: m(t))(model, x)), ref) <= 1e-5
    h = model.run_layers(model.embed_tokens(x), 0, 1)
    assert _rel_err(np.asarray(h), np.load(path / "hidden_after_layer0.npy")) <= 1e-5
    # a layer unrolled (routed through `linear`, as a site's is) and the others scanned
    # compute the same: the scan carries each layer's bias and window with its weights
    for hooked in ((0,), (1,), (0, 1)):
        logits = np.asarray(model(x, frozen_linear, hooked=hooked))
        assert _rel_err(logits, ref) <= 1e-5, hooked


@pytest.mark.parametrize("name", ["gqa_llama3", "qwen3_qknorm"])
def test_documents_packed_in_a_window_give_the_logits_each_gives_alone(name):
    """Three documents in one window (the first one's start cut off by the window's),
    flagged where the second and third start: each position's logits are those of its
    document run alone (attention within it, RoPE counted from its start), whole and with
    a site layer hooked; the same window unflagged is one document."""
    model = load_hf(FIXTURES / name)
    x = np.load(FIXTURES / name / "tokens.npy")[:1]
    a, b, c = x[:, :4], x[:, 4:9], x[:, 9:]
    starts = np.zeros(x.shape, bool)
    starts[:, [4, 9]] = True
    packed = documents.mark(x, starts)
    alone = np.concatenate([np.asarray(model(d)) for d in (a, b, c)], axis=1)
    prefix, suffix = model.split(("layers.1.mlp.up_proj",))
    for got in (model(packed), model(packed, frozen_linear, hooked=(0,)),
                suffix(prefix(packed))):
        assert _rel_err(np.asarray(got), alone) <= 1e-5
    assert _rel_err(np.asarray(model(x)), np.load(FIXTURES / name / "logits.npy")[:1]) <= 1e-5
    assert _rel_err(np.asarray(model(x)), alone) > 1e-2  # the flags matter


@pytest.mark.jax_versions  # the loader's variants
def test_what_each_config_json_makes_of_its_flags():
    biases = {n: load_config(FIXTURES / n).bias for n in VARIANTS}
    assert biases == {"llama_bias": ("q_proj", "k_proj", "v_proj", "o_proj"),
                      "qwen2_bias": ("q_proj", "k_proj", "v_proj"), "mistral_window": (),
                      "qwen2_window": ("q_proj", "k_proj", "v_proj"), "qwen3_qknorm": ()}
    windows = {n: load_config(FIXTURES / n).windows for n in VARIANTS}
    assert windows == {"llama_bias": (), "qwen2_bias": (), "mistral_window": (8, 8),
                       "qwen2_window": (0, 6), "qwen3_qknorm": ()}
    assert [n for n in VARIANTS if load_config(FIXTURES / n).qk_norm] == ["qwen3_qknorm"]
    qwen3 = load_config(FIXTURES / "qwen3_qknorm")
    assert qwen3.d_head == 24 != qwen3.hidden_size // qwen3.num_attention_heads


@pytest.mark.jax_versions  # the loader's variants
def test_qwen2_without_use_sliding_window_ignores_its_window(tmp_path):
    """The Hub's Qwen2 configs carry a sliding_window with use_sliding_window false, which
    transformers ignores: so does the loader (the logits stay those of full attention)."""
    path = _variant(tmp_path, "q", base="qwen2_bias", sliding_window=4, use_sliding_window=False,
                    layer_types=None)
    assert load_config(path).windows == ()
    x = np.load(path / "tokens.npy")
    assert _rel_err(np.asarray(load_hf(path)(x)), np.load(path / "logits.npy")) <= 1e-5


@pytest.mark.jax_versions  # the loader's variants
@pytest.mark.parametrize(("config", "message"), [
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
     "model_type 'qwen3_moe' is not computed by this loader"),
    ({"use_sliding_window": True, "sliding_window": 4,
      "layer_types": ["full_attention", "chunked_attention"]},
     "layer_types=.* is not computed by this loader"),
])
def test_a_qwen3_this_loader_does_not_compute_is_refused_in_one_line(tmp_path, config, message):
    path = _variant(tmp_path, "q3", base="qwen3_qknorm", **config)
    with pytest.raises(CheckpointError, match=message) as e:
        load_hf(path)
    assert "\n" not in str(e.value)


@pytest.mark.jax_versions  # the loader's variants
def test_qk_norm_gains_the_config_implies_must_be_stored(tmp_path):
    path = _variant(tmp_path, "n", base="qwen3_qknorm")
    from safetensors.numpy import load_file, save_file

    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor model.layers.1.self_attn.k_norm.weight "
                                              r"missing"):
        load_hf(path)


@pytest.mark.slow  # a compile of its own: outside the quick tier
def test_a_qwen3_checkpoint_decomposes_its_attention():
    """Sites in a Qwen3's attention (the projections QK-norm reads): the steps run, every
    term finite, and the components move towards the weights (faithfulness falls)."""
    cfg = tiny_cfg()
    recon = {k: dc.replace(t, sites_per_chunk=min(t.sites_per_chunk, 2))
             for k, t in cfg.loss.recon.items()}
    cfg = dc.replace(cfg, model=dc.replace(cfg.model, path=str(FIXTURES / "qwen3_qknorm")),
                     layers=dc.replace(cfg.layers, sites=[
                         "layers.1.self_attn.q_proj", "layers.1.self_attn.k_proj"], C=8),
                     loss=dc.replace(cfg.loss, recon=recon))
    validate(cfg)
    target = load_hf(cfg.model.path)
    spec = resolve(cfg).step
    state = init_state(jax.random.PRNGKey(1), spec, target)
    step = jax.jit(make_train_step(spec))
    x = np.load(FIXTURES / "qwen3_qknorm" / "tokens.npy")[:, :8]
    faith = []
    for _ in range(5):
        state, metrics = step(state, target, x)
        assert all(np.isfinite(float(v)) for k, v in metrics.items() if k.startswith("loss/"))
        faith.append(float(metrics["loss/faithfulness"]))
    assert faith == sorted(faith, reverse=True) and faith[-1] < faith[0], faith


@pytest.mark.jax_versions  # the loader's variants
def test_a_bias_the_config_implies_must_be_stored(tmp_path):
    path = _variant(tmp_path, "b", attention_bias=True)
    with pytest.raises(CheckpointError, match=r"tensor model.layers.0.self_attn.q_proj.bias "
                                              r"missing"):
        load_hf(path)


@pytest.mark.slow  # 15 s: outside the quick tier (make test-fast)
def test_a_model_without_a_checkpoint_takes_the_flags_and_decomposes():
    """model.attn_bias and model.sliding_window give a pathless Llama its biases and window:
    the window changes the logits once the sequence outgrows it, and a decomposition step
    with sites in the biased, windowed layers runs and learns."""
    cfg = tiny_cfg()
    model = dc.replace(cfg.model, attn_bias=["q_proj", "k_proj", "v_proj"], sliding_window=4)
    cfg = dc.replace(cfg, model=model)
    validate(cfg)
    target = targets.init_target(jax.random.PRNGKey(0), cfg.model)
    assert set(target.attn_bias) == {"q_proj", "k_proj", "v_proj"}
    assert target.cfg.windows == (4,) * cfg.model.n_layers
    x = tokens(cfg)  # seq 8 > window 4
    full = dc.replace(target, cfg=dc.replace(target.cfg, windows=()))
    assert float(jnp.abs(target(x) - full(x)).max()) > 1e-3
    spec = resolve(cfg).step
    state = init_state(jax.random.PRNGKey(1), spec, target)
    step = jax.jit(make_train_step(spec))
    losses = []
    for _ in range(5):
        state, metrics = step(state, target, x)
        losses.append(float(metrics["loss/total"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize(("field", "value", "message"), [
    ("attn_bias", ["q_proj", "qkv"], "model.attn_bias"),
    ("sliding_window", -1, "model.sliding_window"),
])
@pytest.mark.jax_versions  # the loader's variants
def test_bad_flags_are_named(field, value, message):
    cfg = tiny_cfg()
    with pytest.raises(ConfigError, match=message):
        validate(dc.replace(cfg, model=dc.replace(cfg.model, **{field: value})))

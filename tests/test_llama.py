"""The Llama target against transformers' LlamaForCausalLM (committed fixtures, no torch)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdecomp.spd.components import frozen_linear
from pdecomp.targets.hf_checkpoint import CheckpointError, check_hf, load_config, load_hf
from pdecomp.targets.llama import init_llama

pytestmark = pytest.mark.jax_versions  # the checkpoint loader and its logits

FIXTURES = Path(__file__).parent / "fixtures" / "llama"
CHECKPOINTS = ["gqa_llama3", "tied_sharded"]


def _rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_transformers(name):
    path = FIXTURES / name
    model = load_hf(path)
    tokens = np.load(path / "tokens.npy")
    logits = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))
    assert _rel_err(logits, np.load(path / "logits.npy")) <= 1e-5
    h = model.run_layers(model.embed_tokens(tokens), 0, 1)
    assert _rel_err(np.asarray(h), np.load(path / "hidden_after_layer0.npy")) <= 1e-5


def test_fixtures_cover_gqa_llama3_scaling_ties_and_shards():
    gqa, tied = load_config(FIXTURES / "gqa_llama3"), load_config(FIXTURES / "tied_sharded")
    assert gqa.num_key_value_heads < gqa.num_attention_heads
    assert gqa.rope_scaling["rope_type"] == "llama3" and not gqa.tie_word_embeddings
    assert tied.tie_word_embeddings and load_hf(FIXTURES / "tied_sharded").lm_head is None
    assert len(list((FIXTURES / "tied_sharded").glob("model-*.safetensors"))) > 1


def test_hooked_layers_route_sites_and_keep_the_logits():
    """Unrolled layers call linear(site, ...) with HF names; scanned ones do not; the numbers
    are the same either way."""
    model = load_hf(FIXTURES / "gqa_llama3")
    tokens = np.load(FIXTURES / "gqa_llama3" / "tokens.npy")
    seen: list[str] = []

    def linear(site, x, W):
        seen.append(site)
        return frozen_linear(site, x, W)

    logits = model(tokens, linear, hooked=(1,))
    assert sorted(seen) == sorted(f"layers.1.{p}" for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    np.testing.assert_allclose(logits, model(tokens), rtol=1e-5, atol=1e-6)
    assert set(model.site_weights()) >= set(seen)


def test_loads_into_shardings_from_each_hosts_own_copy():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    abstract = jax.eval_shape(lambda: init_llama(jax.random.PRNGKey(0),
                                                 load_config(FIXTURES / "gqa_llama3")))
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
    model = load_hf(FIXTURES / "gqa_llama3", shardings=shardings)
    assert model.mlp["up_proj"].sharding == NamedSharding(mesh, P())
    reference = load_hf(FIXTURES / "gqa_llama3")
    np.testing.assert_array_equal(model.mlp["up_proj"], reference.mlp["up_proj"])


def test_bf16_storage():
    model = load_hf(FIXTURES / "gqa_llama3", dtype=jnp.bfloat16)
    assert model.attn["q_proj"].dtype == jnp.bfloat16


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(tmp_path / "nowhere")
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / "gqa_llama3", bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(CheckpointError, match=r"gate_proj.weight has shape \(160, 64\)"):
        load_hf(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    with pytest.raises(CheckpointError, match="model.layers.3.* missing"):
        load_hf(bad)
    sharded = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "tied_sharded", sharded)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard model-00002.* missing"):
        load_hf(sharded)


def test_a_shard_reads_only_its_block_of_a_tensor():
    """What make_array_from_callback asks of each device: one block, of the [d_in, d_out]
    transpose of HF's [d_out, d_in] storage."""
    from safetensors.numpy import load_file

    from pdecomp.targets.hf_checkpoint import _Tensors

    path = FIXTURES / "gqa_llama3"
    full = load_file(str(path / "model.safetensors"))["model.layers.1.mlp.up_proj.weight"]
    block = (slice(16, 48), slice(40, 80))
    got = _Tensors(path).read("model.layers.1.mlp.up_proj.weight", block, transpose=True)
    np.testing.assert_array_equal(got, full.T[block])


def _variant(tmp_path: Path, name: str, base: str = "gqa_llama3", tensors: dict | None = None,
             **config) -> Path:
    """A copy of a fixture with config.json fields set (None: removed) and tensors added."""
    from safetensors.numpy import load_file, save_file

    path = tmp_path / name
    shutil.copytree(FIXTURES / base, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(config)
    (path / "config.json").write_text(json.dumps(cfg))
    if tensors:
        stored = load_file(str(path / "model.safetensors"))
        save_file({**stored, **tensors}, str(path / "model.safetensors"))
    return path


REFUSED = [
    ("gemma", {"model_type": "gemma"}, "model_type 'gemma'"),
    ("gemma-arch", {"architectures": ["GemmaForCausalLM"]}, "GemmaForCausalLM"),
    # a Llama computes attention_bias (tests/test_llama_variants.py); a Mistral ignores it
    ("mistral-attention-bias", {"model_type": "mistral", "attention_bias": True},
     "attention_bias=true"),
    ("qwen2-layer-type", {"model_type": "qwen2", "layer_types": ["chunked_attention"] * 3},
     'layer_types=["chunked_attention"'),
    ("mlp-bias", {"mlp_bias": True}, "mlp_bias=true"),
    ("gelu", {"hidden_act": "gelu"}, 'hidden_act="gelu"'),
    ("llama-window", {"sliding_window": 16}, "sliding_window=16"),
    ("layer-types", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ("yarn", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ("linear-rope-legacy-key", {"rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_type='linear'"),
    ("softcap", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("partial-rope", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("partial-rope-v5", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                             "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5"),
]


@pytest.mark.parametrize(("config", "message"),
                         [pytest.param(c, m, id=i) for i, c, m in REFUSED])
def test_checkpoints_it_would_not_compute_are_refused(tmp_path, config, message):
    """A field that changes the computation away from its neutral value is named, with the
    file, before anything is read (a wrong model must never load quietly)."""
    path = _variant(tmp_path, "v", **config)
    with pytest.raises(CheckpointError, match=re.escape(message)) as e:
        load_hf(path)
    assert str(path / "config.json") in str(e.value) and "allowed" in str(e.value)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
ROPE_REFUSED = [
    ("dynamic", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type='dynamic'"),
    ("yarn-rope-parameters", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                  "rope_theta": 1e4}},
     "rope_parameters.rope_type='yarn'"),
    ("llama3-no-low-freq", {"rope_scaling": {k: v for k, v in LLAMA3.items()
                                             if k != "low_freq_factor"}},
     "rope_scaling.low_freq_factor is missing"),
    ("llama3-factor-text", {"rope_scaling": {**LLAMA3, "factor": "8"}},
     "rope_scaling.factor='8'"),
    ("llama3-band-inverted", {"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}},
     "rope_scaling.high_freq_factor=1.0"),
    ("not-a-mapping", {"rope_scaling": "llama3"}, "rope_scaling='llama3'"),
]


@pytest.mark.parametrize(("config", "message"),
                         [pytest.param(c, m, id=i) for i, c, m in ROPE_REFUSED])
def test_rope_settings_it_would_not_compute_are_refused_from_the_headers(tmp_path, config,
                                                                        message):
    """Every RoPE field the computation reads is checked with config.json, by the header
    check the launcher runs (not only once the step is traced)."""
    path = _variant(tmp_path, "v", **config)
    with pytest.raises(CheckpointError, match=re.escape(message)) as e:
        check_hf(path)
    assert str(path / "config.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage", ["truncated", "header-length", "header-json", "empty"])
def test_a_damaged_safetensors_file_is_named(tmp_path, damage):
    """A truncated file or a damaged header is a CheckpointError naming the file (it was the
    safetensors library's own exception, with no file named)."""
    path = _variant(tmp_path, damage)
    damage_safetensors(path / "model.safetensors", damage)
    with pytest.raises(CheckpointError, match="unreadable safetensors file") as e:
        check_hf(path)
    assert str(path / "model.safetensors") in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_shard_or_index_is_named(tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "tied_sharded", sharded)
    shard = next(sharded.glob("model-00003-*.safetensors"))
    damage_safetensors(shard, "truncated")
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: unreadable safetensors")):
        check_hf(sharded)
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: unreadable index"):
        check_hf(sharded)


def damage_safetensors(path: Path, damage: str) -> None:
    """Damage a safetensors file in place the ways a copy or a download goes wrong."""
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) * 2 // 3])
    elif damage == "header-length":  # the 8-byte header length, overwritten
        path.write_bytes(b"\xff" * 8 + data[8:])
    elif damage == "header-json":
        path.write_bytes(data[:8] + b"#" * 16 + data[24:])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        raise AssertionError(damage)


def test_a_tensor_it_would_not_compute_is_refused(tmp_path):
    """A tensor the model has no use for (a q_proj bias) is refused; RoPE's stored
    frequencies carry nothing the config does not, and are passed over."""
    bias = {"model.layers.0.self_attn.q_proj.bias": np.ones(64, np.float32)}
    with pytest.raises(CheckpointError, match=r"tensor model.layers.0.self_attn.q_proj.bias "
                                              r"is not computed"):
        load_hf(_variant(tmp_path, "bias", tensors=bias))
    inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    load_hf(_variant(tmp_path, "inv_freq", tensors=inv_freq))


def test_neutral_values_and_mistral_without_a_window_load_as_llama(tmp_path):
    """Mistral with sliding_window null is Llama's computation, and fields at their neutral
    value change nothing: the logits stay transformers' Llama logits."""
    path = _variant(tmp_path, "mistral", model_type="mistral", sliding_window=None,
                    architectures=["MistralForCausalLM"], attention_bias=False,
                    hidden_act="silu", layer_types=["full_attention"] * 3)
    tokens = np.load(path / "tokens.npy")
    logits = np.asarray(jax.jit(lambda m, t: m(t))(load_hf(path), tokens))
    assert _rel_err(logits, np.load(path / "logits.npy")) <= 1e-5


def test_a_refused_checkpoint_on_the_command_line_exits_2_with_one_line(tmp_path):
    import subprocess

    from conftest import PDECOMP

    path = _variant(tmp_path, "gelu", hidden_act="gelu")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.run([PDECOMP, "+experiment=llama_tiny_chunkwise", f"model.path={path}",
                           "layers.sites=[layers.1.mlp.gate_proj,layers.1.mlp.up_proj,layers.1.mlp.down_proj]",
                           "gate.only=true"],
                          cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "model.path" in lines[0] and 'hidden_act="gelu"' in lines[0], lines[0]
    assert list(cwd.iterdir()) == []


def _stored_as(src: Path, dest: Path, dtype) -> Path:
    """`src`'s checkpoint (sharded or not) with every tensor stored in `dtype`."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as h:
            tensors = {k: h.get_tensor(k).astype(dtype) for k in h.keys()}  # noqa: SIM118
        save_file(tensors, str(dest / f.name))
    return dest


@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 3e-2), ("float16", 2e-3)])
def test_half_precision_sharded_checkpoints_load_exactly(tmp_path: Path, dtype: str,
                                                         tolerance: float) -> None:
    """The Hub's checkpoints come in bfloat16 or float16: read as stored (each value that
    very number in float32), to transformers' float32 logits within the rounding."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    src = FIXTURES / "tied_sharded"
    half = load_hf(_stored_as(src, tmp_path / dtype, np_dtype))
    rounded = jax.tree.map(lambda w: w.astype(np_dtype).astype(np.float32), load_hf(src))
    for got, want in zip(jax.tree.leaves(half), jax.tree.leaves(rounded), strict=True):
        assert got.dtype == jnp.float32 and np.array_equal(np.asarray(got), np.asarray(want))
    tokens = np.load(src / "tokens.npy")
    logits = np.asarray(jax.jit(lambda m, t: m(t))(half, tokens))
    assert 0 < _rel_err(logits, np.load(src / "logits.npy")) <= tolerance


def test_a_quantized_tensor_is_refused_with_its_dtype(tmp_path: Path) -> None:
    path = _stored_as(FIXTURES / "gqa_llama3", tmp_path / "int8", np.int8)
    with pytest.raises(CheckpointError, match=r"int8: tensor model.embed_tokens.weight is "
                                              r"stored as I8; this loader reads F32, BF16, F16"):
        check_hf(path)

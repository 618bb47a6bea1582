"""Generate tiny Hugging Face Llama-family checkpoints + reference logits for JAX parity tests.

Run with a Python that has torch + transformers + safetensors + numpy (NOT the project env;
torch/transformers are deliberately not project dependencies), from the repo root:

    python scripts/make_llama_fixtures.py [NAME ...]

It rewrites the named fixtures (all without names) under ``tests/fixtures/llama/``, each with
a ``generated_with.json`` naming the versions that wrote it, and the README.md listing them.
Output is deterministic for a given torch/transformers version (fixed seeds, fp32, eager
attention, CPU).

Fixtures written (all float32, standard HF layout: config.json + safetensors):

* ``gqa_llama3/``   - 3 layers, 8 query heads / 2 KV heads (GQA), head_dim=8, untied lm_head,
  llama3 RoPE scaling. ``config.json`` is rewritten in the legacy/Hub layout (top-level
  ``rope_theta`` + ``rope_scaling`` dict, as in meta-llama/Llama-3.x checkpoints).
* ``tied_sharded/`` - 2 layers, 4 heads / 4 KV heads, tied embeddings, default RoPE, saved in
  several ``model-0000X-of-0000N.safetensors`` shards + ``model.safetensors.index.json``.
  ``config.json`` is left in the layout the installed transformers writes (v5: ``rope_parameters``).

* ``llama_bias/``, ``qwen2_bias/`` - attention projections with a bias: Llama's
  ``attention_bias`` (q, k, v and o), Qwen2's q, k and v.
* ``mistral_window/`` - Mistral with a sliding window of 8 tokens (< the 24 of the tokens),
  in every layer.
* ``qwen2_window/`` - Qwen2 with ``use_sliding_window`` and ``max_window_layers: 1``: layer 0
  attends to the whole prefix, layer 1 to a window of 6.

Each fixture also holds ``tokens.npy`` (int32 [2, 24]), ``logits.npy`` (float32 [2, 24, vocab])
and ``hidden_after_layer0.npy`` (float32 [2, 24, hidden], output of decoder layer 0).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import safetensors
import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "llama"
BATCH, SEQ = 2, 24
# family -> (config class, model class, modeling module whose helpers `sensitivity` patches)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, modeling_llama),
    "mistral": (MistralConfig, MistralForCausalLM, modeling_mistral),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, modeling_qwen2),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, modeling_qwen3),
}
# The variants' shared shape: 2 layers, GQA 4/2, head_dim 16.
SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim=8 and theta=5e5 the wavelengths are ~6.3, 167, 4.4e3, 1.2e5. A window of
    # 256 puts them in all three llama3 branches: < 64 kept, in [64, 256] smoothed, > 256 / factor.
    "original_max_position_embeddings": 256,
}

FIXTURES = {
    "gqa_llama3": {
        "seed": 1234,
        "legacy_config": True,
        "max_shard_size": None,
        "config": {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 8,
            # > original_max_position_embeddings (HF warns otherwise); = 256 * factor as in Llama 3.
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": dict(LLAMA3_SCALING),
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
        },
    },
    "tied_sharded": {
        "seed": 5678,
        "legacy_config": False,
        "max_shard_size": "100KB",
        "config": {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
        },
    },
    "llama_bias": {
        "seed": 91, "family": "llama", "legacy_config": False, "max_shard_size": None,
        "config": {**SMALL, "rope_theta": 10000.0, "attention_bias": True, "mlp_bias": False},
    },
    "qwen2_bias": {
        "seed": 92, "family": "qwen2", "legacy_config": False, "max_shard_size": None,
        "config": {**SMALL, "rope_theta": 1000000.0, "use_sliding_window": False},
    },
    "mistral_window": {
        "seed": 93, "family": "mistral", "legacy_config": False, "max_shard_size": None,
        "config": {**SMALL, "rope_theta": 10000.0, "sliding_window": 8},
    },
    "qwen2_window": {
        "seed": 94, "family": "qwen2", "legacy_config": False, "max_shard_size": None,
        "config": {**SMALL, "rope_theta": 10000.0, "use_sliding_window": True,
                   "sliding_window": 6, "max_window_layers": 1},
    },
    # QK-norm (an RMSNorm over each head's query and key before RoPE, its weights not ones),
    # a head_dim (24) that is not hidden / heads (16), tied embeddings
    "qwen3_qknorm": {
        "seed": 95, "family": "qwen3", "legacy_config": False, "max_shard_size": None,
        "config": {**SMALL, "head_dim": 24, "rope_theta": 1000000.0,
                   "tie_word_embeddings": True, "attention_bias": False,
                   "use_sliding_window": False},
    },
}


def make_config(cfg: dict, family: str = "llama"):
    config = FAMILIES[family][0](**cfg, dtype="float32")
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def reinit_(model: LlamaForCausalLM, gen: torch.Generator) -> None:
    """Re-initialise so activations and attention patterns are O(1) (HF init is tiny-std).

    Linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 0.5^2), RMSNorm weights ~ 1 + 0.1 N(0, 1),
    biases ~ N(0, 0.5^2). Tied weights are visited once (named_parameters de-duplicates).
    """
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif "embed_tokens" in name or name.endswith(".bias"):
            p.copy_(0.5 * noise)
        elif p.ndim == 2:
            p.copy_(noise / math.sqrt(p.shape[1]))
        else:
            raise AssertionError(f"unexpected parameter {name} {tuple(p.shape)}")


@torch.no_grad()
def forward(model: LlamaForCausalLM, tokens: np.ndarray):
    captured = {}
    handle = model.model.layers[0].register_forward_hook(
        lambda mod, args, out: captured.__setitem__("h0", out[0] if isinstance(out, tuple) else out)
    )
    try:
        out = model(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True)
    finally:
        handle.remove()
    h0 = out.hidden_states[1]
    assert torch.equal(h0, captured["h0"]), "hidden_states[1] is not decoder layer 0's output"
    return out.logits.float().numpy(), h0.float().numpy()


def check_llama3_inv_freq(model: LlamaForCausalLM, cfg: dict) -> None:
    head_dim, theta = cfg["head_dim"], cfg["rope_theta"]
    unscaled = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    scaled = model.model.rotary_emb.inv_freq.float()
    s = cfg["rope_scaling"]
    factor, omp = s["factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / unscaled
    kept = torch.isclose(scaled, unscaled, rtol=1e-6, atol=0)
    divided = torch.isclose(scaled, unscaled / factor, rtol=1e-6, atol=0)
    smoothed = ~kept & ~divided
    print(f"  wavelen   : {[round(w, 2) for w in wavelen.tolist()]}")
    print(
        f"  thresholds: high_freq_wavelen={omp / s['high_freq_factor']} "
        f"low_freq_wavelen={omp / s['low_freq_factor']}"
    )
    print(f"  inv_freq unscaled: {unscaled.tolist()}")
    print(f"  inv_freq HF llama3: {scaled.tolist()}")
    print(f"  kept={kept.tolist()} divided={divided.tolist()} smoothed={smoothed.tolist()}")
    assert kept.any() and not kept.all(), "llama3 scaling should change some but not all inv_freq"
    assert divided.any() and smoothed.any(), "want all three llama3 branches exercised"


@torch.no_grad()
def sensitivity(name: str, model, cfg: dict, tokens, ref: np.ndarray,
                family: str = "llama") -> None:
    """Show that the reference logits actually depend on the details a port can get wrong."""
    model_class, modeling = FAMILIES[family][1], FAMILIES[family][2]
    diffs = {}

    def without(key: str, value=None):  # the same weights, `key` at `value` (None: default)
        other = {k: v for k, v in cfg.items() if k != key} | ({key: value} if value else {})
        plain = model_class(make_config(other, family)).eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        return np.abs(forward(plain, tokens)[0] - ref).max()

    if "rope_scaling" in cfg:
        diffs["no_llama3_scaling"] = without("rope_scaling")
    if family == "mistral" and cfg.get("sliding_window"):
        diffs["no_sliding_window"] = without("sliding_window", None)
    if family == "qwen2" and cfg.get("use_sliding_window"):
        diffs["no_sliding_window"] = without("use_sliding_window", None)
    if family == "qwen3":  # each head's query and key as they come, not normalized
        norms = [m for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))]
        for m in norms:
            m.forward = lambda x: x
        diffs["no_qk_norm"] = np.abs(forward(model, tokens)[0] - ref).max()
        for m in norms:
            del m.forward
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    if biases:
        saved = [b.clone() for b in biases]
        for b in biases:
            b.zero_()
        diffs["no_attention_bias"] = np.abs(forward(model, tokens)[0] - ref).max()
        for b, v in zip(biases, saved, strict=True):
            b.copy_(v)

    orig_rotate, orig_repeat = modeling.rotate_half, modeling.repeat_kv

    def rotate_interleaved(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    try:
        modeling.rotate_half = rotate_interleaved
        diffs["interleaved_rotate_half"] = np.abs(forward(model, tokens)[0] - ref).max()
    finally:
        modeling.rotate_half = orig_rotate
    if cfg["num_key_value_heads"] != cfg["num_attention_heads"]:
        try:
            modeling.repeat_kv = lambda h, n: h if n == 1 else h.repeat(1, n, 1, 1)
            diffs["kv_tile_instead_of_repeat"] = np.abs(forward(model, tokens)[0] - ref).max()
        finally:
            modeling.repeat_kv = orig_repeat
    # Sanity: patches restored.
    assert np.array_equal(forward(model, tokens)[0], ref)
    for k, v in diffs.items():
        print(f"  sensitivity {name}: max|dlogit| if {k}: {v:.4f}")
        assert v > 1e-2, f"reference logits insensitive to {k}"


def rewrite_legacy_config(path: Path) -> None:
    """Rewrite config.json in the Hub/transformers-4.x layout: rope_theta + rope_scaling."""
    cfg = json.loads(path.read_text())
    if "rope_parameters" in cfg:
        rp = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rp.pop("rope_theta")
        cfg["rope_scaling"] = rp
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build(name: str, spec: dict, versions: dict) -> dict:
    print(f"== {name}")
    cfg, family = spec["config"], spec.get("family", "llama")
    model_class = FAMILIES[family][1]
    torch.manual_seed(spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"])
    model = model_class(make_config(cfg, family)).eval()
    reinit_(model, gen)
    if cfg["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if "rope_scaling" in cfg:
        check_llama3_inv_freq(model, cfg)

    tokens = torch.randint(0, cfg["vocab_size"], (BATCH, SEQ), generator=gen).numpy()
    tokens = tokens.astype(np.int32)
    logits, h0 = forward(model, tokens)
    print(f"  logits std={logits.std():.3f} max|.|={np.abs(logits).max():.3f}")
    sensitivity(name, model, cfg, tokens, logits, family)

    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    kw = {} if spec["max_shard_size"] is None else {"max_shard_size": spec["max_shard_size"]}
    model.save_pretrained(d, safe_serialization=True, **kw)
    if spec["legacy_config"]:
        rewrite_legacy_config(d / "config.json")
    np.save(d / "tokens.npy", tokens)
    np.save(d / "logits.npy", logits.astype(np.float32))
    np.save(d / "hidden_after_layer0.npy", h0.astype(np.float32))
    (d / "generated_with.json").write_text(json.dumps(versions, indent=2, sort_keys=True) + "\n")

    shards = sorted(d.glob("model-*-of-*.safetensors"))
    if spec["max_shard_size"] is not None:
        assert len(shards) >= 2 and (d / "model.safetensors.index.json").exists(), shards
        assert not (d / "model.safetensors").exists()
    else:
        assert (d / "model.safetensors").exists() and not shards

    # Round trip: reload from disk (this also checks the rewritten legacy config is understood).
    again = model_class.from_pretrained(d, attn_implementation="eager", dtype=torch.float32)
    again.eval()
    re_logits, re_h0 = forward(again, tokens)
    np.testing.assert_array_equal(re_logits, logits)
    np.testing.assert_array_equal(re_h0, h0)
    print(f"  reload OK ({len(shards) or 1} weight file(s))")
    return {"shards": len(shards) or 1}


def main(names: list[str]) -> None:
    torch.set_num_threads(1)  # fixed reduction order on CPU
    unknown = sorted(set(names) - set(FIXTURES))
    if unknown:
        raise SystemExit(f"unknown fixture {unknown[0]}; allowed: {', '.join(FIXTURES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }
    print("versions:", versions)
    for name in names or FIXTURES:
        build(name, FIXTURES[name], versions)

    def made_with(name: str) -> str:
        got = OUT / name / "generated_with.json"
        v = json.loads(got.read_text()) if got.exists() else {}
        return ", ".join(f"{k} {v[k]}" for k in sorted(v)) or "versions not recorded"

    shards = len(list((OUT / "tied_sharded").glob("model-*-of-*.safetensors")))
    readme = f"""# Llama-family parity fixtures

Tiny random Hugging Face checkpoints (float32, `save_pretrained` + safetensors) of the Llama
family with reference outputs, for checking the JAX port against transformers without torch.
Generated by `scripts/make_llama_fixtures.py` (CPU, eager attention, `torch.no_grad()`); each
directory's `generated_with.json` names the versions that wrote it.

Every directory holds `tokens.npy` (int32 [2, 24]), `logits.npy` (float32 [2, 24, 128], from
`model(tokens).logits`) and `hidden_after_layer0.npy` (float32 [2, 24, 64], decoder layer 0
output = `output_hidden_states[1]`). Weights: linear ~ N(0, 1/fan_in), embeddings and biases
~ N(0, 0.25), RMSNorm weights ~ 1 + 0.1 N(0, 1), so attention patterns, biases and norms
matter (the script checks that each feature moves the logits by more than 1e-2).

- `gqa_llama3/` (`LlamaForCausalLM`; {made_with("gqa_llama3")}): 3 layers, hidden 64, 8 query
  heads / 2 KV heads (GQA), head_dim 8, intermediate 160, vocab 128, max_position_embeddings
  2048, untied `lm_head`, rope_theta 5e5, llama3 scaling (factor 8, low/high_freq_factor 1/4,
  original_max_position_embeddings 256, chosen so the four frequencies hit all three llama3
  branches: kept, smoothed, divided by factor). `config.json` is in the Hub /
  transformers-4.x layout: top-level `rope_theta` + `rope_scaling` dict. Single
  `model.safetensors`.
- `tied_sharded/` (`LlamaForCausalLM`; {made_with("tied_sharded")}): 2 layers, 4 heads / 4 KV
  heads, head_dim 16, rope_theta 1e4 (no scaling), `tie_word_embeddings: true` (no
  `lm_head.weight` stored). Saved with max_shard_size
  {FIXTURES["tied_sharded"]["max_shard_size"]} into {shards} shards +
  `model.safetensors.index.json`. `config.json` is left as transformers writes it (RoPE
  settings in `rope_parameters`).
- The variants, 2 layers, 4 heads / 2 KV heads, head_dim 16, intermediate 96:
  - `llama_bias/` (`LlamaForCausalLM`, `attention_bias: true`: q, k, v and o add a bias;
    {made_with("llama_bias")});
  - `qwen2_bias/` (`Qwen2ForCausalLM`: q, k and v add a bias, o does not; rope_theta 1e6;
    {made_with("qwen2_bias")});
  - `mistral_window/` (`MistralForCausalLM`, `sliding_window: 8`, shorter than the 24 tokens,
    in every layer; {made_with("mistral_window")});
  - `qwen2_window/` (`Qwen2ForCausalLM`, `use_sliding_window: true`, `sliding_window: 6`,
    `max_window_layers: 1`: layer 0 full, layer 1 windowed; also q/k/v biases;
    {made_with("qwen2_window")});
  - `qwen3_qknorm/` (`Qwen3ForCausalLM`: QK-norm, an RMSNorm over each head's query and
    key before RoPE, its weights not ones; head_dim 24, not hidden / heads; tied
    embeddings; rope_theta 1e6; {made_with("qwen3_qknorm")}).

Regenerate (needs torch + transformers + safetensors, which are not project dependencies):

    python scripts/make_llama_fixtures.py [NAME ...]
"""
    (OUT / "README.md").write_text(readme)

    total = 0
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            total += p.stat().st_size
            print(f"  {p.stat().st_size:>9,d}  {p.relative_to(OUT)}")
    print(f"total {total:,d} bytes ({total / 2**20:.2f} MiB)")
    assert total < 3 * 2**20, "fixtures should stay under ~3 MB"


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])

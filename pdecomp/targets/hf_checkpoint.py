"""Hugging Face checkpoints of the Llama target: config.json read into its `LlamaConfig`
(a model this loader would not compute exactly is refused), every tensor checked by its
header, and the weights read lazily into place, each process its own shards."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401 - numpy's bfloat16, for safetensors' BF16 tensors
import numpy as np
from jaxtyping import Array

from pdecomp.core.config import LLAMA_ATTN as ATTN
from pdecomp.core.config import LLAMA_MLP as MLP
from pdecomp.core.config import rope_problem
from pdecomp.targets.llama import Llama, LlamaConfig, init_llama


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete, or does not match its config."""


def attention_bias(data: dict[str, Any]) -> tuple[str, ...]:
    """The projections transformers builds with a bias for this config.json: Qwen2's q, k
    and v always; all four of a Llama's or a Qwen3's with `attention_bias`."""
    if data.get("model_type") == "qwen2":
        return ("q_proj", "k_proj", "v_proj")
    with_flag = data.get("model_type") in ("llama", "qwen3") and data.get("attention_bias")
    return ATTN if with_flag else ()


def layer_windows(data: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it (0: full causal attention):
    Mistral's `sliding_window` in every layer; Qwen2's and Qwen3's only with
    `use_sliding_window`, in the layers `layer_types` names sliding (by default those from
    `max_window_layers` on)."""
    kind, n = data.get("model_type"), int(data.get("num_hidden_layers", 0))
    window = data.get("sliding_window")
    if kind == "mistral" and window:
        return (int(window),) * n
    if kind in ("qwen2", "qwen3") and window and data.get("use_sliding_window"):
        first = data.get("max_window_layers", 28)
        types = data.get("layer_types") or ["sliding_attention" if i >= first else
                                             "full_attention" for i in range(n)]
        windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
        return windows if any(windows) else ()
    return ()


def config_from_hf(data: dict[str, Any]) -> LlamaConfig:
    """A config.json's architecture. Both layouts of the RoPE settings: top-level `rope_theta` + `rope_scaling` (the
    Hub's Llama-3 checkpoints) and `rope_parameters` (what transformers 5 writes)."""
    names = {f.name for f in fields(LlamaConfig)} - {"bias", "windows", "qk_norm"}
    kwargs = {k: v for k, v in data.items() if k in names and v is not None}
    kwargs["bias"], kwargs["windows"] = attention_bias(data), layer_windows(data)
    kwargs["qk_norm"] = data.get("model_type") == "qwen3"
    rope = data.get("rope_parameters")
    if rope:
        kwargs["rope_theta"] = rope.get("rope_theta", kwargs.get("rope_theta", 10_000.0))
        if rope.get("rope_type", "default") != "default":
            kwargs["rope_scaling"] = rope
    return LlamaConfig(**kwargs)


def _hf_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {"attn_norm": p + "input_layernorm.weight",
            "mlp_norm": p + "post_attention_layernorm.weight",
            **{n: f"{p}self_attn.{n}.weight" for n in ATTN},
            **{n: f"{p}mlp.{n}.weight" for n in MLP}}


def _hf_bias(i: int, name: str) -> str:
    return f"model.layers.{i}.self_attn.{name}.bias"


def _hf_qk_norm(i: int, name: str) -> str:
    return f"model.layers.{i}.self_attn.{name}.weight"


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape (HF stores linear weights as [d_out, d_in])."""
    d, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.d_head, cfg.num_key_value_heads * cfg.d_head
    per_layer = {"attn_norm": (d,), "mlp_norm": (d,), "q_proj": (q, d), "k_proj": (kv, d),
                 "v_proj": (kv, d), "o_proj": (d, q), "gate_proj": (inter, d),
                 "up_proj": (inter, d), "down_proj": (d, inter)}
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(cfg.num_hidden_layers):
        out |= {hf: per_layer[k] for k, hf in _hf_names(i).items()}
        out |= {_hf_bias(i, n): per_layer[n][:1] for n in cfg.bias}
        if cfg.qk_norm:
            out |= {_hf_qk_norm(i, n): (cfg.d_head,) for n in ("q_norm", "k_norm")}
    return out


class _Tensors:
    """Lazy access to the tensors of a single-file or sharded safetensors checkpoint."""

    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: unreadable index, need JSON with a "
                                      f"weight_map of tensor -> shard file ({e})") from None
        elif (path / "model.safetensors").exists():
            files, weight_map = ["model.safetensors"], None
        else:
            raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
        self.handles = {}
        for f in files:
            if not (path / f).exists():
                raise CheckpointError(f"{path}: shard {f} named in the index is missing")
            # safe_open parses the header and checks that its tensors' offsets cover the file
            # exactly: a truncated file or a damaged header fails here, before any read.
            try:
                self.handles[f] = safe_open(str(path / f), framework="np")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path / f}: unreadable safetensors file (truncated or "
                                      f"damaged?): {str(e).splitlines()[0]}") from None
        only = self.handles[files[0]]
        self.where = weight_map or {k: files[0] for k in only.keys()}  # noqa: SIM118 - not a dict

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return str(self.handles[self.where[name]].get_slice(name).get_dtype())

    def read(self, name: str, index: tuple[slice, ...], transpose: bool) -> np.ndarray:
        """Only the block `index` of tensor `name` (of its transpose): a host reads the parts
        its own devices hold, never the whole tensor for a shard of it."""
        part = self.handles[self.where[name]].get_slice(name)
        return part[index[::-1]].T if transpose else part[index]


# The stored dtypes read, each into the dtype the run asks for: float32, and the half
# precisions the Hub's checkpoints come in (numpy reads BF16 through ml_dtypes' bfloat16).
FLOAT_DTYPES = ("F32", "BF16", "F16")

# What this model computes, and the config.json fields that would make a checkpoint compute
# something else unless they sit at their neutral value. A checkpoint of another family, or
# with such a field set, is refused: loading it would decompose a model the user did not
# name, and nothing downstream could tell.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM")
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "attention_bias": (lambda v: not v, "false (q/k/v/o projections without bias)"),
    "mlp_bias": (lambda v: not v, "false (MLP projections without bias)"),
    "hidden_act": (lambda v: v == "silu", "silu"),
    "sliding_window": (lambda v: v is None, "null (full causal attention)"),
    "use_sliding_window": (lambda v: not v, "false"),
    "layer_types": (lambda v: all(t == "full_attention" for t in v),
                    "full_attention in every layer"),
    "pretraining_tp": (lambda v: v in (None, 1), "1"),
    "use_qk_norm": (lambda v: not v, "false"),
    "attn_logit_softcapping": (lambda v: v is None, "null"),
    "final_logit_softcapping": (lambda v: v is None, "null"),
    # transformers rotates only this fraction of each head's dimensions when it is set
    "partial_rotary_factor": (lambda v: v == 1, "1.0 (RoPE over the whole head)"),
}
# The NEUTRAL fields a model_type computes (`attention_bias`, `layer_windows`); elsewhere
# transformers ignores them, and a value other than neutral says the author meant a model
# this loader would not compute.
COMPUTED = {"llama": ("attention_bias",), "mistral": ("sliding_window",),
            "qwen2": ("sliding_window", "use_sliding_window", "layer_types"),
            "qwen3": ("attention_bias", "sliding_window", "use_sliding_window", "layer_types")}
# Tensors that carry no computation of their own: RoPE's frequencies (recomputed from the
# config) and, with tied embeddings, a stored copy of the head (transformers ties it over).
IGNORED_TENSORS = (r"\.rotary_emb\.inv_freq$",)


def check_computable(data: dict[str, Any], where: str) -> None:
    """Refuse a config.json this model would not compute exactly (CheckpointError naming
    the field and what is allowed)."""
    kind = data.get("model_type")
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {kind!r} is not computed by this loader; "
                              f"allowed: {', '.join(MODEL_TYPES)}")
    archs = [a for a in data.get("architectures") or [] if a not in ARCHITECTURES]
    if archs:
        raise CheckpointError(f"{where}: architectures {archs} are not computed by this "
                              f"loader; allowed: {', '.join(ARCHITECTURES)}")
    for key, (neutral, allowed) in NEUTRAL.items():
        if key not in COMPUTED[kind] and key in data and data[key] is not None and not neutral(data[key]):
            raise CheckpointError(f"{where}: {key}={json.dumps(data[key])} is not computed by "
                                  f"this loader; allowed: {allowed}")
    kinds = {"full_attention", "sliding_attention"}
    if kind in ("qwen2", "qwen3") and not set(data.get("layer_types") or ()) <= kinds:
        raise CheckpointError(f"{where}: layer_types={json.dumps(data['layer_types'])} is not "
                              f"computed by this loader; allowed: {', '.join(sorted(kinds))}")
    for key in ("rope_scaling", "rope_parameters"):
        if problem := rope_problem(data.get(key)):
            name, value, allowed = problem
            what = f"{key}.{name}" if name else key
            shown = f"{what} is missing" if value is None else (
                f"{what}={value!r} is not computed by this loader")
            raise CheckpointError(f"{where}: {shown}; {allowed}")


def load_config(path: str | Path) -> LlamaConfig:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face model directory)")
    data = json.loads((path / "config.json").read_text())
    check_computable(data, str(path / "config.json"))
    return config_from_hf(data)


def check_hf(path: str | Path) -> LlamaConfig:
    """config.json readable and every tensor present with the shape it implies (headers
    only: cheap enough to run before the gate)."""
    return _open_checked(Path(path))[0]


def _open_checked(path: Path) -> tuple[LlamaConfig, _Tensors]:
    cfg = load_config(path)
    tensors = _Tensors(path)
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in tensors.where:
            raise CheckpointError(f"{path}: tensor {name} missing (config.json: "
                                  f"{cfg.num_hidden_layers} layers, tied="
                                  f"{cfg.tie_word_embeddings})")
        if tensors.shape(name) != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {tensors.shape(name)}; "
                                  f"config.json implies {shape}")
        if (stored := tensors.dtype(name)) not in FLOAT_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} is stored as {stored}; this loader "
                                  f"reads {', '.join(FLOAT_DTYPES)} (a quantized checkpoint: "
                                  "dequantize it first, as pdecomp convert does a GGUF)")
    ignored = IGNORED_TENSORS + ((r"^lm_head\.weight$",) if cfg.tie_word_embeddings else ())
    extra = sorted(n for n in tensors.where
                   if n not in expected and not any(re.search(p, n) for p in ignored))
    if extra:
        raise CheckpointError(f"{path}: tensor {extra[0]} is not computed by this loader "
                              f"({len(extra)} such tensors; a Llama holds embeddings, norms "
                              "and projections, with the biases its config.json implies)")
    return cfg, tensors


def load_hf(path: str | Path, dtype: Any = jnp.float32,
            shardings: Llama | None = None) -> Llama:
    """The Llama in `path` (config.json + safetensors), each array built in its sharding
    from this host's own reads of the files (no cross-host gather of a full copy)."""
    cfg, tensors = _open_checked(Path(path))
    L = cfg.num_hidden_layers

    def stacked(key: str, transpose: bool, name: Callable[[int, str], str] | None = None
                ) -> Callable[[tuple], np.ndarray]:
        """Layer i's tensor `name(i, key)` (default: its weight), stacked over the layers."""
        name = name or (lambda i, k: _hf_names(i)[k])

        def read(index: tuple) -> np.ndarray:
            return np.stack([tensors.read(name(i, key), index[1:], transpose)
                             for i in range(L)[index[0]]]).astype(dtype)
        return read

    def single(name: str, transpose: bool) -> Callable[[tuple], np.ndarray]:
        return lambda index: tensors.read(name, index, transpose).astype(dtype)

    readers: dict[str, Any] = {
        "embed": single("model.embed_tokens.weight", False),
        "attn_norm": stacked("attn_norm", False),
        "attn": {n: stacked(n, True) for n in ATTN},
        "attn_bias": {n: stacked(n, False, _hf_bias) for n in cfg.bias},
        "mlp_norm": stacked("mlp_norm", False),
        "mlp": {n: stacked(n, True) for n in MLP},
        "final_norm": single("model.norm.weight", False),
        "lm_head": None if cfg.tie_word_embeddings else single("lm_head.weight", True),
        "q_norm": stacked("q_norm", False, _hf_qk_norm) if cfg.qk_norm else None,
        "k_norm": stacked("k_norm", False, _hf_qk_norm) if cfg.qk_norm else None,
    }
    abstract = jax.eval_shape(lambda: init_llama(jax.random.PRNGKey(0), cfg, dtype))
    return _materialize(abstract, readers, shardings)


def _materialize(abstract: Llama, readers: dict[str, Any], shardings: Llama | None) -> Llama:
    def build(x: jax.ShapeDtypeStruct, read: Callable, sharding: Any) -> Array:
        if sharding is None:
            return jnp.asarray(read((slice(None),) * len(x.shape)))
        return jax.make_array_from_callback(x.shape, sharding, read)

    values = {}
    for name in ("embed", "attn_norm", "attn", "attn_bias", "mlp_norm", "mlp", "final_norm",
                 "lm_head", "q_norm", "k_norm"):
        a, r = getattr(abstract, name), readers[name]
        s = getattr(shardings, name) if shardings is not None else None
        if a is None:
            values[name] = None
        elif isinstance(a, dict):
            values[name] = {k: build(a[k], r[k], s[k] if s else None) for k in a}
        else:
            values[name] = build(a, r, s)
    return Llama(**values, cfg=abstract.cfg)

"""A Llama-family target in Equinox, loaded from a Hugging Face directory.

GQA attention, RoPE (with Llama-3's "llama3" frequency scaling), RMSNorm, SwiGLU MLP, tied
or untied embeddings; the family's variants by their flags: attention projections with a
bias (Qwen2's q/k/v, Llama's `attention_bias`) and a sliding attention window (Mistral's
every layer, Qwen2's layers from `max_window_layers` on). Per-layer weights are stacked on a
leading layer axis so runs of layers that hold no decomposed site run under one `lax.scan`.
Layers that hold a site route each matmul through the caller's `linear(site, x, W)` with
HF-style site names (`layers.18.mlp.gate_proj`, `layers.3.self_attn.q_proj`, ...); given a
`SiteLinear`, a run of them whose sites read alike is scanned too, its sites' data stacked
over the layers (the program then holds one traced layer per run, not one per layer).
Weights are [d_in, d_out].

Numerics follow transformers' LlamaForCausalLM: RMSNorm in fp32 and cast back before its
weight; softmax in fp32; query head h reads kv head h // (n_heads / n_kv_heads); RoPE
rotates the two halves of each head (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from pdecomp.blocks import apply_rope, rms_norm, rope_inv_freq, rope_tables
from pdecomp.components import LinearFn, SiteLinear, dot, einsum, frozen_linear
from pdecomp.config import LLAMA_ATTN as ATTN
from pdecomp.config import LLAMA_MLP as MLP
from pdecomp.config import ModelConfig, rope_problem


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete, or does not match its config."""


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a HF `config.json` the model needs (others are ignored)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 160
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 0  # 0: hidden_size / num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    # Not config.json names: what its model_type makes of its fields (`from_hf`).
    bias: tuple[str, ...] = ()  # the attention projections that add a bias
    windows: tuple[int, ...] = ()  # each layer's sliding window, 0 for none; (): none at all

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @staticmethod
    def from_hf(data: dict[str, Any]) -> LlamaConfig:
        """Both layouts of the RoPE settings: top-level `rope_theta` + `rope_scaling` (the
        Hub's Llama-3 checkpoints) and `rope_parameters` (what transformers 5 writes)."""
        names = {f.name for f in fields(LlamaConfig)} - {"bias", "windows"}
        kwargs = {k: v for k, v in data.items() if k in names and v is not None}
        kwargs["bias"], kwargs["windows"] = attention_bias(data), layer_windows(data)
        rope = data.get("rope_parameters")
        if rope:
            kwargs["rope_theta"] = rope.get("rope_theta", kwargs.get("rope_theta", 10_000.0))
            if rope.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = rope
        return LlamaConfig(**kwargs)


def attention_bias(data: dict[str, Any]) -> tuple[str, ...]:
    """The projections transformers builds with a bias for this config.json: Qwen2's q, k
    and v always; all four of a Llama's with `attention_bias`."""
    if data.get("model_type") == "qwen2":
        return ("q_proj", "k_proj", "v_proj")
    return ATTN if data.get("model_type") == "llama" and data.get("attention_bias") else ()


def layer_windows(data: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it (0: full causal attention):
    Mistral's `sliding_window` in every layer; Qwen2's only with `use_sliding_window`, in
    the layers `layer_types` names sliding (by default those from `max_window_layers` on)."""
    kind, n = data.get("model_type"), int(data.get("num_hidden_layers", 0))
    window = data.get("sliding_window")
    if kind == "mistral" and window:
        return (int(window),) * n
    if kind == "qwen2" and window and data.get("use_sliding_window"):
        first = data.get("max_window_layers", 28)
        types = data.get("layer_types") or ["sliding_attention" if i >= first else
                                             "full_attention" for i in range(n)]
        windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
        return windows if any(windows) else ()
    return ()


def arch(model: ModelConfig) -> LlamaConfig:
    """The architecture of a run's Llama: config.json when a path is given, else the fields
    of the model config (a pathless preset such as llama3_8b carries the real shapes)."""
    if model.path:
        return load_config(model.path)
    return LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.d_embed, intermediate_size=model.d_mlp,
        num_hidden_layers=model.n_layers, num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads, head_dim=model.head_dim,
        rms_norm_eps=model.rms_norm_eps, rope_theta=model.rope_theta,
        rope_scaling=dict(model.rope_scaling) or None, tie_word_embeddings=model.tie_embeddings,
        bias=tuple(model.attn_bias),
        windows=(model.sliding_window,) * model.n_layers if model.sliding_window else ())


def site_layer(site: str) -> int:
    """`layers.18.mlp.gate_proj` -> 18."""
    return int(site.split(".")[1])


def site_name(i: int, name: str) -> str:
    """(18, "gate_proj") -> `layers.18.mlp.gate_proj`."""
    return f"layers.{i}.{'self_attn' if name in ATTN else 'mlp'}.{name}"


# What a scanned run of site layers keeps per layer for its backward when rematerialized
# (`memory.site_layer_saves`), as a `jax.checkpoint` policy: `linears` every matmul
# without a batch dimension (the frozen linears and the components': attention,
# norms and activations recomputed); `sites` only the components' inner activations and
# each site's output (the frozen linears recomputed too, a small share of the
# FLOPs); `nothing` the layer's input alone (the components' matmuls recomputed as well).
# In order of what they keep, most first (a refusal names those after the run's).
_cp = jax.checkpoint_policies
SITE_LAYER_SAVES: dict[str, Callable | None] = {
    "linears": _cp.dots_with_no_batch_dims_saveable,
    "sites": _cp.save_only_these_names("site_inner", "site_out"),
    "nothing": None,
}


def _reads(linear: LinearFn, i: int) -> Any:
    """What layer i's sites read from a `SiteLinear` (names, structure, shapes): layers
    that read alike can share one scan. A plain linear fn: each layer its own."""
    if not isinstance(linear, SiteLinear):
        return i
    read = {n: linear.data[site_name(i, n)] for n in (*ATTN, *MLP)
            if site_name(i, n) in linear.data}
    return jax.tree.structure(read), [(x.shape, x.dtype) for x in jax.tree.leaves(read)]


class Llama(eqx.Module):
    """Weights stacked over layers: `attn[name]` is [L, d_in, d_out] for each of ATTN, etc."""

    embed: Float[Array, "vocab d"]
    attn_norm: Float[Array, "L d"]
    attn: dict[str, Array]
    attn_bias: dict[str, Float[Array, "L d_out"]]  # of the projections in cfg.bias
    mlp_norm: Float[Array, "L d"]
    mlp: dict[str, Array]
    final_norm: Float[Array, " d"]
    lm_head: Float[Array, "d vocab"] | None
    cfg: LlamaConfig = eqx.field(static=True)

    @property
    def n_layers(self) -> int:
        return self.attn_norm.shape[0]

    def site_weights(self) -> dict[str, Array]:
        out = {}
        for i in range(self.n_layers):
            out |= {f"layers.{i}.self_attn.{n}": self.attn[n][i] for n in ATTN}
            out |= {f"layers.{i}.mlp.{n}": self.mlp[n][i] for n in MLP}
        return out

    def layer(self, i: int | slice | Array) -> dict[str, Any]:
        """Layer `i`'s weights (a slice: stacked, for a scan; a traced index: read from the
        stack in place), its biases and its window."""
        w = {"attn_norm": self.attn_norm[i], "mlp_norm": self.mlp_norm[i],
             **{n: self.attn[n][i] for n in ATTN}, **{n: self.mlp[n][i] for n in MLP},
             "bias": {n: b[i] for n, b in self.attn_bias.items()}}
        if self.cfg.windows:
            w["window"] = jnp.asarray(self.cfg.windows, jnp.int32)[i]
        return w

    def rope(self, t: int) -> tuple[Array, Array]:
        cfg = self.cfg
        return rope_tables(rope_inv_freq(cfg.d_head, cfg.rope_theta, cfg.rope_scaling), t)

    def block(self, h: Float[Array, "b t d"], w: dict[str, Any], rope: tuple[Array, Array],
              linear: Callable[[str, Array, Array], Array], operand: Any = None) -> Array:
        """One decoder layer; `linear(name, x, W)` with name one of ATTN + MLP. A bias is
        not decomposed: it is added to what the (decomposed or frozen) weight computes.
        `operand`: the attention's matmuls' operand dtype (`components.dot`)."""
        cfg, (cos, sin) = self.cfg, rope
        b, t, _ = h.shape
        n_h, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.d_head

        def attn_proj(name: str, x: Array) -> Array:
            y = linear(name, x, w[name])
            return y + w["bias"][name].astype(y.dtype) if name in w["bias"] else y

        x = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps)
        q = apply_rope(attn_proj("q_proj", x).reshape(b, t, n_h, d), cos, sin)
        k = apply_rope(attn_proj("k_proj", x).reshape(b, t, n_kv, d), cos, sin)
        v = attn_proj("v_proj", x).reshape(b, t, n_kv, d)
        # grouped heads: query head h = g * rep + r reads kv head g
        q = q.reshape(b, t, n_kv, n_h // n_kv, d)
        scores = einsum("bqgrd,bkgd->bgrqk", q, k, operand) / math.sqrt(d)
        causal = jnp.tril(jnp.ones((t, t), bool))
        if "window" in w:  # a query sees its `window` latest keys, itself included
            pos = jnp.arange(t)
            causal &= (w["window"] == 0) | (pos[:, None] - pos[None, :] < w["window"])
        scores = jnp.where(causal, scores.astype(jnp.float32), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        ctx = einsum("bgrqk,bkgd->bqgrd", probs, v, operand).reshape(b, t, n_h * d)
        h = h + attn_proj("o_proj", ctx)
        x = rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps)
        gated = jax.nn.silu(linear("gate_proj", x, w["gate_proj"])) * linear("up_proj", x,
                                                                              w["up_proj"])
        # A tag for remat policies that keep (or offload) each layer's output.
        return checkpoint_name(h + linear("down_proj", gated, w["down_proj"]), "layer_out")

    def embed_tokens(self, tokens: Int[Array, "b t"]) -> Array:
        return self.embed[tokens]

    def run_layers(self, h: Array, start: int, stop: int, linear: LinearFn = frozen_linear,
                   hooked: Sequence[int] = (), streams: dict[int, Array] | None = None,
                   remat: bool = False, saves: str = "linears", operand: Any = None
                   ) -> Array:
        """Layers [start, stop): runs of the layers not in `hooked` under one scan each
        (compile time flat in depth), and so runs of hooked layers whose sites read alike
        when `linear` is a `SiteLinear`; other hooked layers unrolled with named sites.
        `streams`, when given, receives the residual stream entering each hooked layer.
        `remat`: a backward through the scanned layers recomputes each layer from its input
        instead of keeping every layer's activations (attention scores included) at once;
        a run of site layers keeps what `saves` names in SITE_LAYER_SAVES. `operand`: the
        frozen layers' matmuls' operand dtype (a `SiteLinear` carries the site layers')."""
        rope = self.rope(h.shape[1])
        i = start
        while i < stop:
            j = i + 1
            if i in hooked:
                reads = _reads(linear, i)
                while j < stop and j in hooked and _reads(linear, j) == reads:
                    j += 1
                h = (self._scan_sites(h, i, j, linear, rope, streams, remat, saves) if j - i > 1 else
                     self._hooked(h, i, linear, rope, streams, operand))
                i = j
                continue
            while j < stop and j not in hooked:
                j += 1

            def body(carry, k):
                return self.block(carry, self.layer(k), rope,
                                  lambda _, x, W: dot(x, W, operand), operand), None

            # Over the layers' indices, each layer's weights read in place: scanned over
            # `self.layer(slice(i, j))`, XLA copied the run's weights out of the stack first
            # (SmolLM2's 28 leading layers: three 94.5 MiB temporaries; on an H100 the step
            # went from 7.1 to 6.2 ms). The hooked runs below keep the slice: indexed there,
            # the 8B preset's peak grew 1.7 GiB.
            h, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, h,
                                jnp.arange(i, j))
            i = j
        return h

    def _hooked(self, h: Array, i: int, linear: LinearFn, rope: tuple[Array, Array],
                streams: dict[int, Array] | None, operand: Any) -> Array:
        """Layer i with its sites named `layers.i.<part>.<name>`."""
        if streams is not None:
            streams[i] = h
        return self.block(h, self.layer(i), rope, lambda n, x, W: linear(site_name(i, n), x, W),
                          operand)

    def _scan_sites(self, h: Array, i: int, j: int, linear: SiteLinear,
                    rope: tuple[Array, Array], streams: dict[int, Array] | None,
                    remat: bool, saves: str) -> Array:
        """Hooked layers [i, j), whose sites read data of one shape, under one scan: one
        traced layer however many there are. Each site's data is stacked over the layers;
        the layers' site inputs (when `linear` records) and entering streams come out as
        the scan's outputs."""
        names = [n for n in (*ATTN, *MLP) if site_name(i, n) in linear.data]
        stacked = {n: jax.tree.map(lambda *a: jnp.stack(a),
                                   *[linear.data[site_name(k, n)] for k in range(i, j)])
                   for n in names}
        recording = linear.record is not None

        def body(carry, xs):
            w, data = xs
            seen: dict[str, Array] = {}

            def site_linear(name: str, x: Array, W: Array) -> Array:
                if name not in data:
                    return dot(x, W, linear.operand)
                if recording:
                    seen[name] = x
                return linear.apply(data[name], x, W, linear.operand)

            out = self.block(carry, w, rope, site_linear, linear.operand)
            return out, (carry if streams is not None else None, seen)

        # `remat` here keeps what `saves` names (by default the layer's matmuls without a
        # batch dimension: the linears, the components' among them, most of a site layer's
        # FLOPs) and recomputes the rest: at least the attention's two einsums and softmax,
        # whose [B, heads, T, T] scores would otherwise be kept for every layer of the run.
        if remat:
            body = jax.checkpoint(body, policy=SITE_LAYER_SAVES[saves])
        h, (entering, seen) = jax.lax.scan(body, h, (self.layer(slice(i, j)), stacked))
        for k in range(i, j):
            if streams is not None:
                streams[k] = entering[k - i]
            if recording:
                linear.record.update({site_name(k, n): x[k - i] for n, x in seen.items()})
        return h

    def split(self, sites: Sequence[str], dtype: Any, remat_layers: bool = False,
              site_layer_saves: str = "linears", matmul_dtype: Any = None
              ) -> tuple[Callable, Callable]:
        """(prefix, suffix) around the first layer that holds a site.

        The prefix (embedding and the layers before it) runs once per batch outside every
        gradient graph. `suffix(h, linear, streams=None, live=None)` runs the rest with the
        site layers hooked and returns the logits; the clean forward passes `streams` to
        collect the residual entering each site layer. A forward whose live sites are
        `live` starts from the clean stream at its first live layer (the layers before it
        are all frozen, so the result is the same) and hooks only the live layers: a
        chunk's forward costs its own layers and those after it, not the whole suffix.
        Every matmul of both takes `matmul_dtype` operands (`components.dot`; None: `dtype`).
        """
        hooked = sorted({site_layer(s) for s in sites})
        start = hooked[0]

        op = matmul_dtype

        def prefix(tokens: Array) -> Array:
            return self.run_layers(self.embed_tokens(tokens).astype(dtype), 0, start,
                                   operand=op)

        def suffix(h: Array, linear: LinearFn = frozen_linear,
                   streams: dict[int, Array] | None = None,
                   live: Sequence[str] | None = None) -> Array:
            if isinstance(linear, SiteLinear):
                linear = replace(linear, operand=op)
            if live is None or not streams:
                return self.logits(self.run_layers(h, start, self.n_layers, linear, hooked,
                                                   streams, remat_layers, site_layer_saves,
                                                   op), op)
            live_layers = sorted({site_layer(s) for s in live})
            first = live_layers[0]
            return self.logits(self.run_layers(streams[first], first, self.n_layers, linear,
                                               live_layers, remat=remat_layers,
                                               saves=site_layer_saves, operand=op), op)

        return prefix, suffix

    def logits(self, h: Array, operand: Any = None) -> Float[Array, "b t vocab"]:
        h = rms_norm(h, self.final_norm, self.cfg.rms_norm_eps)
        return dot(h, self.embed.T if self.lm_head is None else self.lm_head, operand)

    def __call__(self, tokens: Int[Array, "b t"], linear: LinearFn = frozen_linear,
                 hooked: Sequence[int] = ()) -> Array:
        h = self.run_layers(self.embed_tokens(tokens), 0, self.n_layers, linear, hooked)
        return self.logits(h)


# -- Hugging Face checkpoints ---------------------------------------------------------------


def _hf_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {"attn_norm": p + "input_layernorm.weight",
            "mlp_norm": p + "post_attention_layernorm.weight",
            **{n: f"{p}self_attn.{n}.weight" for n in ATTN},
            **{n: f"{p}mlp.{n}.weight" for n in MLP}}


def _hf_bias(i: int, name: str) -> str:
    return f"model.layers.{i}.self_attn.{name}.bias"


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

    def read(self, name: str, index: tuple[slice, ...], transpose: bool) -> np.ndarray:
        """Only the block `index` of tensor `name` (of its transpose): a host reads the parts
        its own devices hold, never the whole tensor for a shard of it."""
        part = self.handles[self.where[name]].get_slice(name)
        return part[index[::-1]].T if transpose else part[index]


# What this model computes, and the config.json fields that would make a checkpoint compute
# something else unless they sit at their neutral value. A checkpoint of another family, or
# with such a field set, is refused: loading it would decompose a model the user did not
# name, and nothing downstream could tell.
MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
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
            "qwen2": ("sliding_window", "use_sliding_window", "layer_types")}
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
    if kind == "qwen2" and not set(data.get("layer_types") or ()) <= kinds:
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
    return LlamaConfig.from_hf(data)


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
                 "lm_head"):
        a, r = getattr(abstract, name), readers[name]
        s = getattr(shardings, name) if shardings is not None else None
        if a is None:
            values[name] = None
        elif isinstance(a, dict):
            values[name] = {k: build(a[k], r[k], s[k] if s else None) for k in a}
        else:
            values[name] = build(a, r, s)
    return Llama(**values, cfg=abstract.cfg)


def init_llama(key: Array, cfg: LlamaConfig, dtype: Any = jnp.float32) -> Llama:
    """Random weights of the right shapes (the gate's abstract target; tests)."""
    L, d, inter, v = (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                      cfg.vocab_size)
    q, kv = cfg.num_attention_heads * cfg.d_head, cfg.num_key_value_heads * cfg.d_head
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
              "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}
    keys = iter(jax.random.split(key, 16))

    def normal(shape, std):
        return (std * jax.random.normal(next(keys), shape)).astype(dtype)

    # Unit-scale embeddings and 1/sqrt(fan_in) matrices: every layer moves the residual
    # stream by about as much as it holds, so a random model's MLPs matter to its output
    # (with a small uniform init they barely would, and there would be nothing to decompose).
    return Llama(
        embed=normal((v, d), 1.0), attn_norm=jnp.ones((L, d), dtype),
        attn={n: normal((L, *shapes[n]), shapes[n][0] ** -0.5) for n in ATTN},
        attn_bias={n: normal((L, shapes[n][1]), 0.5) for n in cfg.bias},
        mlp_norm=jnp.ones((L, d), dtype),
        mlp={n: normal((L, *shapes[n]), shapes[n][0] ** -0.5) for n in MLP},
        final_norm=jnp.ones((d,), dtype),
        lm_head=None if cfg.tie_word_embeddings else normal((d, v), d ** -0.5), cfg=cfg)

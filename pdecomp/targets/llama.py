"""A Llama-family target in Equinox (its Hugging Face checkpoints: `pdecomp.targets.hf_checkpoint`).

GQA attention, RoPE (with Llama-3's "llama3" frequency scaling), RMSNorm, SwiGLU MLP, tied
or untied embeddings; the family's variants by their flags: attention projections with a
bias (Qwen2's q/k/v, Llama's `attention_bias`), a sliding attention window (Mistral's every
layer, Qwen2's layers from `max_window_layers` on), and QK-norm (Qwen3's RMSNorm over each
head's query and key before RoPE, with a head_dim of its own). Per-layer weights are stacked
on a leading layer axis so runs of layers that hold no decomposed site run under one
`lax.scan`. Layers that hold a site route each matmul through the caller's `linear(site, x,
W)` with HF-style site names (`layers.18.mlp.gate_proj`, `layers.3.self_attn.q_proj`, ...);
given a `SiteLinear`, a run of them whose sites read alike is scanned too, its sites' data
stacked over the layers (the program then holds one traced layer per run, not one per
layer).
Weights are [d_in, d_out].

Numerics follow transformers' LlamaForCausalLM: RMSNorm in fp32 and cast back before its
weight; softmax in fp32; query head h reads kv head h // (n_heads / n_kv_heads); RoPE
rotates the two halves of each head (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from pdecomp.core import documents
from pdecomp.core.blocks import apply_rope, rms_norm, rope_inv_freq, rope_tables
from pdecomp.core.config import LLAMA_ATTN as ATTN
from pdecomp.core.config import LLAMA_MLP as MLP
from pdecomp.core.memory import PLAIN, MemoryPolicy
from pdecomp.spd.components import (
    Groups,
    LinearFn,
    Recorded,
    SiteLinear,
    dot,
    einsum,
    frozen_linear,
    take,
)


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
    # Not config.json names: what its model_type makes of its fields
    # (`hf_checkpoint.config_from_hf`).
    bias: tuple[str, ...] = ()  # the attention projections that add a bias
    windows: tuple[int, ...] = ()  # each layer's sliding window, 0 for none; (): none at all
    qk_norm: bool = False  # Qwen3's RMSNorm over each head's query and key, before RoPE

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def site_layer(site: str) -> int:
    """`layers.18.mlp.gate_proj` -> 18."""
    return int(site.split(".")[1])


def site_name(i: int, name: str) -> str:
    """(18, "gate_proj") -> `layers.18.mlp.gate_proj`."""
    return f"layers.{i}.{'self_attn' if name in ATTN else 'mlp'}.{name}"


def _reads(linear: LinearFn, i: int) -> Any:
    """What layer i's sites read from a `SiteLinear` (kinds, groups, the shapes of a member's
    data): layers that read alike, each the next member of its groups, can share one scan. A
    plain linear fn: each layer its own."""
    if not isinstance(linear, SiteLinear):
        return i
    read = {n: linear.where[site_name(i, n)][0] for n in (*ATTN, *MLP)
            if site_name(i, n) in linear.where}
    data = {n: linear.data[g] for n, g in read.items()}
    return read, jax.tree.structure(data), [(x.shape[1:], x.dtype)
                                            for x in jax.tree.leaves(data)]


def _follows(linear: LinearFn, i: int, j: int) -> bool:
    """Layer j's sites are the members right after layer i's in each of their groups."""
    return all(linear.where[site_name(j, n)][1] == k + j - i
               for n in (*ATTN, *MLP) if site_name(i, n) in linear.where
               for k in [linear.where[site_name(i, n)][1]])


class Context(NamedTuple):
    """Where each position of a batch sits, for the attention: RoPE's tables over the
    window, each token's position in its document and its document's index there."""

    cos: Array  # [t, 1, d_head]
    sin: Array
    position: Array  # int32 [b, t]
    segment: Array  # int32 [b, t]


class Resid(NamedTuple):
    """The residual stream entering the first site layer, and the batch's document flags
    (`documents.START` bits), which the attention of every later layer reads."""

    h: Array  # [b, t, d]
    flags: Array  # int32 [b, t]


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
    # QK-norm's gains, each head's (cfg.qk_norm; None without)
    q_norm: Float[Array, "L d_head"] | None = None
    k_norm: Float[Array, "L d_head"] | None = None

    @property
    def n_layers(self) -> int:
        return self.attn_norm.shape[0]

    def site_weights(self) -> dict[str, Array]:
        out = {}
        for i in range(self.n_layers):
            out |= {f"layers.{i}.self_attn.{n}": self.attn[n][i] for n in ATTN}
            out |= {f"layers.{i}.mlp.{n}": self.mlp[n][i] for n in MLP}
        return out

    def weight_stacks(self, layout: Groups) -> dict[str, tuple[Array, Array]]:
        """Each group's weights where they are: (its kind's [L, d_in, d_out] stack, the layer
        of each member), read in place by `components.faithfulness_into`."""
        out = {}
        for g, ss in layout.members:
            name = ss[0].rsplit(".", 1)[-1]
            out[g] = (self.attn[name] if name in ATTN else self.mlp[name],
                      jnp.asarray([site_layer(s) for s in ss], jnp.int32))
        return out

    def layer(self, i: int | slice | Array) -> dict[str, Any]:
        """Layer `i`'s weights (a slice: stacked, for a scan; a traced index: read from the
        stack in place), its biases and its window."""
        w = {"attn_norm": self.attn_norm[i], "mlp_norm": self.mlp_norm[i],
             **{n: self.attn[n][i] for n in ATTN}, **{n: self.mlp[n][i] for n in MLP},
             "bias": {n: b[i] for n, b in self.attn_bias.items()}}
        if self.cfg.windows:
            w["window"] = jnp.asarray(self.cfg.windows, jnp.int32)[i]
        if self.cfg.qk_norm:
            w["q_norm"], w["k_norm"] = self.q_norm[i], self.k_norm[i]
        return w

    def context(self, flags: Int[Array, "b t"]) -> Context:
        """The attention's context of a batch whose document flags are `flags`."""
        cfg, t = self.cfg, flags.shape[-1]
        cos, sin = rope_tables(rope_inv_freq(cfg.d_head, cfg.rope_theta, cfg.rope_scaling), t)
        return Context(cos, sin, *documents.segments(flags))

    def block(self, h: Float[Array, "b t d"], w: dict[str, Any], ctx: Context,
              linear: Callable[[str, Array, Array], Array], operand: Any = None) -> Array:
        """One decoder layer; `linear(name, x, W)` with name one of ATTN + MLP. A bias is
        not decomposed: it is added to what the (decomposed or frozen) weight computes.
        `operand`: the attention's matmuls' operand dtype (`components.dot`)."""
        cfg = self.cfg
        cos, sin = ctx.cos[ctx.position], ctx.sin[ctx.position]  # each position's, [b, t, 1, d]
        b, t, _ = h.shape
        n_h, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.d_head

        def attn_proj(name: str, x: Array) -> Array:
            y = linear(name, x, w[name])
            return y + w["bias"][name].astype(y.dtype) if name in w["bias"] else y

        x = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps)
        q = attn_proj("q_proj", x).reshape(b, t, n_h, d)
        k = attn_proj("k_proj", x).reshape(b, t, n_kv, d)
        if "q_norm" in w:  # each head's query and key normalized over its own dimensions
            q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = attn_proj("v_proj", x).reshape(b, t, n_kv, d)
        # grouped heads: query head h = g * rep + r reads kv head g
        q = q.reshape(b, t, n_kv, n_h // n_kv, d)
        scores = einsum("bqgrd,bkgd->bgrqk", q, k, operand) / math.sqrt(d)
        causal = jnp.tril(jnp.ones((t, t), bool))
        if "window" in w:  # a query sees its `window` latest keys, itself included
            pos = jnp.arange(t)
            causal &= (w["window"] == 0) | (pos[:, None] - pos[None, :] < w["window"])
        seen = causal & documents.same_document(ctx.segment)
        scores = jnp.where(seen, scores.astype(jnp.float32), -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        attended = einsum("bgrqk,bkgd->bqgrd", probs, v, operand).reshape(b, t, n_h * d)
        h = h + attn_proj("o_proj", attended)
        x = rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps)
        gated = jax.nn.silu(linear("gate_proj", x, w["gate_proj"])) * linear("up_proj", x,
                                                                              w["up_proj"])
        # A tag for remat policies that keep (or offload) each layer's output.
        return checkpoint_name(h + linear("down_proj", gated, w["down_proj"]), "layer_out")

    def embed_tokens(self, tokens: Int[Array, "b t"]) -> Array:
        return self.embed[documents.ids(tokens)]

    def run_layers(self, h: Array, start: int, stop: int, linear: LinearFn = frozen_linear,
                   hooked: Sequence[int] = (), streams: Recorded | None = None,
                   memory: MemoryPolicy = PLAIN, flags: Array | None = None) -> Array:
        """Layers [start, stop): runs of the layers not in `hooked` under one scan each
        (compile time flat in depth), and so runs of hooked layers whose sites read alike
        when `linear` is a `SiteLinear`; other hooked layers unrolled with named sites.
        `streams`, when given, receives the residual stream entering each hooked layer.
        `memory.remat_layers`: a backward through the scanned layers recomputes each layer
        from its input instead of keeping every layer's activations (attention scores
        included) at once; a run of site layers keeps what `memory.site_layer_saves` names.
        `memory.matmul_dtype`: the frozen layers' matmuls' operand dtype (a `SiteLinear`
        carries the site layers'). `flags`: the batch's document flags (None: one document
        a window)."""
        flags = jnp.zeros(h.shape[:2], jnp.int32) if flags is None else flags
        ctx, operand = self.context(flags), memory.matmul_dtype
        i = start
        while i < stop:
            j = i + 1
            if i in hooked:
                reads = _reads(linear, i)
                while j < stop and j in hooked and _reads(linear, j) == reads \
                        and _follows(linear, i, j):
                    j += 1
                h = (self._scan_sites(h, i, j, linear, ctx, streams, memory) if j - i > 1
                     else self._hooked(h, i, linear, ctx, streams, operand))
                i = j
                continue
            while j < stop and j not in hooked:
                j += 1

            def body(carry, k):
                return self.block(carry, self.layer(k), ctx,
                                  lambda _, x, W: dot(x, W, operand), operand), None

            # Over the layers' indices, each layer's weights read in place: scanned over
            # `self.layer(slice(i, j))`, XLA copied the run's weights out of the stack first
            # (SmolLM2's 28 leading layers: three 94.5 MiB temporaries; on an H100 the step
            # went from 7.1 to 6.2 ms). The hooked runs below keep the slice: indexed there,
            # the 8B preset's peak grew 1.7 GiB.
            h, _ = jax.lax.scan(jax.checkpoint(body) if memory.remat_layers else body, h,
                                jnp.arange(i, j))
            i = j
        return h

    def _hooked(self, h: Array, i: int, linear: LinearFn, ctx: Context,
                streams: Recorded | None, operand: Any) -> Array:
        """Layer i with its sites named `layers.i.<part>.<name>`."""
        if streams is not None:
            streams[i] = h
        return self.block(h, self.layer(i), ctx, lambda n, x, W: linear(site_name(i, n), x, W),
                          operand)

    def _scan_sites(self, h: Array, i: int, j: int, linear: SiteLinear,
                    ctx: Context, streams: Recorded | None,
                    memory: MemoryPolicy) -> Array:
        """Hooked layers [i, j), whose sites are successive members of their groups, under
        one scan: one traced layer however many there are. Each kind's data is its group's,
        already stacked (sliced to these layers' members where the group has more); the
        layers' site inputs (when `linear` records) and entering streams come out as the
        scan's outputs."""
        stacked = {}
        for n in (*ATTN, *MLP):
            if site_name(i, n) in linear.where:
                g, k = linear.where[site_name(i, n)]
                leaves = jax.tree.leaves(linear.data[g])
                stacked[n] = linear.data[g] if not leaves else take(
                    linear.data[g], tuple(range(k, k + j - i)), leaves[0].shape[0])
        recording = linear.record is not None

        def body(carry, xs):
            w, data = xs
            seen: dict[str, Array] = {}

            def site_linear(name: str, x: Array, W: Array) -> Array:
                if name not in stacked:
                    return dot(x, W, linear.operand)
                if recording:
                    seen[name] = x
                return linear.apply(data[name], x, W, linear.operand)

            out = self.block(carry, w, ctx, site_linear, linear.operand)
            return out, (carry if streams is not None else None, seen)

        # `remat` here keeps what `saves` names (by default the layer's matmuls without a
        # batch dimension: the linears, the components' among them, most of a site layer's
        # FLOPs) and recomputes the rest: at least the attention's two einsums and softmax,
        # whose [B, heads, T, T] scores would otherwise be kept for every layer of the run.
        if memory.remat_layers:
            body = jax.checkpoint(body, policy=memory.site_layer_policy)
        h, (entering, seen) = jax.lax.scan(body, h, (self.layer(slice(i, j)), stacked))
        if streams is not None:
            streams.put_run(tuple(range(i, j)), entering)
        for n, x in seen.items():
            linear.record.put_run(tuple(site_name(k, n) for k in range(i, j)), x)
        return h

    def split(self, sites: Sequence[str], memory: MemoryPolicy = PLAIN
              ) -> tuple[Callable, Callable]:
        """(prefix, suffix) around the first layer that holds a site.

        The prefix (embedding and the layers before it) runs once per batch outside every
        gradient graph and gives the residual stream entering that layer with the batch's
        document flags (a `Resid`). `suffix(resid, linear, streams=None, live=None)` runs
        the rest with the site layers hooked and returns the logits; the clean forward
        passes `streams` to collect the residual entering each site layer. A forward whose
        live sites are `live` starts from the clean stream at its first live layer (the
        layers before it are all frozen, so the result is the same) and hooks only the live
        layers: a chunk's forward costs its own layers and those after it, not the whole
        suffix.
        The layers compute in `memory.dtype`, every matmul of both takes `memory.matmul_dtype`
        operands (`components.dot`; None: the compute dtype), and the suffix rematerializes
        as `memory` says.
        """
        hooked = sorted({site_layer(s) for s in sites})
        start = hooked[0]

        op = memory.matmul_dtype
        outside_grads = replace(memory, remat_layers=False)  # the prefix has no backward

        def prefix(tokens: Array) -> Resid:
            flags = tokens & documents.START
            return Resid(self.run_layers(self.embed_tokens(tokens).astype(memory.dtype), 0,
                                         start, memory=outside_grads, flags=flags), flags)

        def suffix(resid: Resid, linear: LinearFn = frozen_linear,
                   streams: Recorded | None = None,
                   live: Sequence[str] | None = None) -> Array:
            if isinstance(linear, SiteLinear):
                linear = replace(linear, operand=op)
            if live is None or not streams:
                return self.logits(self.run_layers(resid.h, start, self.n_layers, linear,
                                                   hooked, streams, memory, resid.flags), op)
            live_layers = sorted({site_layer(s) for s in live})
            first = live_layers[0]
            return self.logits(self.run_layers(streams[first], first, self.n_layers, linear,
                                               live_layers, memory=memory,
                                               flags=resid.flags), op)

        return prefix, suffix

    def residual_write(self, site: str, U: Float[Array, "C d_out"]) -> Float[Array, "C d"] | None:
        """What one unit of each row of U, written by `site`, adds to the residual stream,
        where a fixed linear map takes it there: o_proj and down_proj write it as it is;
        v_proj's goes through o_proj as if every query head of its group attended to that
        position alone. None for q_proj and k_proj (they move the attention pattern) and
        gate_proj and up_proj (each meets the other branch in a product)."""
        name = site.rsplit(".", 1)[-1]
        if name in ("o_proj", "down_proj"):
            return U
        if name != "v_proj":
            return None
        cfg = self.cfg
        n_kv, rep = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
        v = U.reshape(U.shape[0], n_kv, 1, cfg.d_head)  # the block's head order: g, r, d
        ctx = jnp.broadcast_to(v, (U.shape[0], n_kv, rep, cfg.d_head)).reshape(U.shape[0], -1)
        return ctx @ self.attn["o_proj"][site_layer(site)].astype(U.dtype)

    def direct_logits(self, write: Float[Array, "C d"]) -> Float[Array, "C vocab"]:
        """The logits a residual write adds by the direct path: the final norm's gain, then
        the unembedding (the norm's division by the residual's scale, positive and the same
        for every token, left out)."""
        unembed = self.embed.T if self.lm_head is None else self.lm_head
        return (write * self.final_norm.astype(write.dtype)) @ unembed.astype(write.dtype)

    def logits(self, h: Array, operand: Any = None) -> Float[Array, "b t vocab"]:
        h = rms_norm(h, self.final_norm, self.cfg.rms_norm_eps)
        return dot(h, self.embed.T if self.lm_head is None else self.lm_head, operand)

    def __call__(self, tokens: Int[Array, "b t"], linear: LinearFn = frozen_linear,
                 hooked: Sequence[int] = ()) -> Array:
        h = self.run_layers(self.embed_tokens(tokens), 0, self.n_layers, linear, hooked,
                            flags=tokens & documents.START)
        return self.logits(h)


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
        lm_head=None if cfg.tie_word_embeddings else normal((d, v), d ** -0.5), cfg=cfg,
        q_norm=jnp.ones((L, cfg.d_head), dtype) if cfg.qk_norm else None,
        k_norm=jnp.ones((L, cfg.d_head), dtype) if cfg.qk_norm else None)

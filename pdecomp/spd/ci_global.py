"""The `global_transformer` CI function: one network over every site's input at once.

Weightless RMSNorm of each site's input, concatenate along features (in the order of `d_in`),
linear to d_model, `n_blocks` pre-norm blocks of bidirectional RoPE attention + GELU MLP,
final norm, linear to ΣC, split per site (each site's head, stacked by group) (docs/method.md, "Causal
importance (CI)").
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from pdecomp.core.blocks import apply_rope, rms_norm, rope_inv_freq, rope_tables
from pdecomp.spd.components import Groups, take

ROPE_THETA = 10000.0
NORM_EPS = 1e-6
# Block output projections start at this fraction of the 1/sqrt(fan_in) scale: the residual
# stream starts close to the input projection (near identity) while every weight inside the
# blocks still gets a gradient from the first step (an exactly-zero output projection would
# leave all the weights behind it without one until it moved).
RESID_OUT_SCALE = 0.1
# Logit head std, times 1/sqrt(d_model): small, so the random features of the untrained
# network do not set the starting CI pattern (|logit - LOGIT_INIT| ~ 0.1).
LOGIT_SCALE = 0.1
# Every logit starts near 0.5, inside (0, 1) where ci_lower passes its whole gradient both
# ways: a logit at 0 would sit on the leaky edge, where pushes up pass at 1% and pushes down
# not at all, and early learning stalls. Half-on components also make the first masks
# 0.5 + 0.5·source, so recon and imp-min both pull from step one.
LOGIT_INIT = 0.5


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float) -> Array:
    return jax.random.normal(key, shape, jnp.float32) * std


def global_transformer_param_count(d_in: Mapping[str, int], C: Mapping[str, int],
                                   d_model: int, n_blocks: int, d_mlp: int) -> int:
    """Parameters of `GlobalCITransformer.init(..)` with these sizes (all fp32)."""
    D, S = sum(d_in.values()), sum(C.values())
    per_block = 4 * d_model * d_model + 2 * d_model * d_mlp + 2 * d_model
    return D * d_model + d_model + n_blocks * per_block + d_model + d_model * S + S


class GlobalCITransformer(eqx.Module):
    """Global CI network; logits for every site from all sites' inputs.

    Block norms (attention, MLP, final) are RMSNorms with a *learnable* scale (init 1); the
    per-site input norms are weightless, so each site's input scale is irrelevant. Block
    weights are stacked on a leading `n_blocks` axis and run with `lax.scan`. Projections
    have no biases except the input and logit linears. Weights are [d_in, d_out].
    """

    w_in: dict[str, Float[Array, "n d_in d_model"]]  # each site's rows, stacked by group
    b_in: Float[Array, " d_model"]
    attn_norm: Float[Array, "L d_model"]
    wq: Float[Array, "L d_model d_model"]
    wk: Float[Array, "L d_model d_model"]
    wv: Float[Array, "L d_model d_model"]
    wo: Float[Array, "L d_model d_model"]
    mlp_norm: Float[Array, "L d_model"]
    w_up: Float[Array, "L d_model d_mlp"]
    w_down: Float[Array, "L d_mlp d_model"]
    final_norm: Float[Array, " d_model"]
    # The logit linear, one head per site, stacked by the components' groups: a site's logits
    # come from its own [d_model, C] block, which shards along C like the site's V and U, and
    # no [*, ΣC] tensor of every site exists at once.
    w_out: dict[str, Float[Array, "n d_model C"]]
    b_out: dict[str, Float[Array, "n C"]]
    layout: Groups = eqx.field(static=True)
    sites: tuple[str, ...] = eqx.field(static=True)
    d_in: tuple[int, ...] = eqx.field(static=True)
    C: tuple[int, ...] = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)

    @staticmethod
    def init(key: PRNGKeyArray, d_in: Mapping[str, int], C: Mapping[str, int], d_model: int,
             n_blocks: int, n_heads: int, d_mlp: int, layout: Groups | None = None
             ) -> GlobalCITransformer:
        if list(d_in) != list(C):
            raise ValueError(f"d_in and C must name the same sites in the same order; got "
                             f"{list(d_in)} and {list(C)}")
        if not C:
            raise ValueError("global_transformer needs at least one site")
        if min(d_model, n_blocks, n_heads, d_mlp) < 1:
            raise ValueError(f"d_model, n_blocks, n_heads, d_mlp must be >= 1; got "
                             f"{d_model}, {n_blocks}, {n_heads}, {d_mlp}")
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if (d_model // n_heads) % 2:
            raise ValueError(f"d_head = d_model // n_heads = {d_model // n_heads} must be even "
                             "(RoPE rotates pairs)")
        D, S, L = sum(d_in.values()), sum(C.values()), n_blocks
        k = jax.random.split(key, 8)
        splits = [sum(list(C.values())[:i]) for i in range(1, len(C))]
        sd, sm = 1 / math.sqrt(d_model), 1 / math.sqrt(d_mlp)
        layout = layout or Groups.of(tuple(C), lambda s: C[s])
        heads = dict(zip(C, jnp.split(_normal(k[7], (d_model, S), LOGIT_SCALE * sd), splits,
                                      axis=1)))
        return GlobalCITransformer(
            w_in=layout.stack(dict(zip(C, jnp.split(
                _normal(k[0], (D, d_model), 1 / math.sqrt(D)),
                [sum(list(d_in.values())[:i]) for i in range(1, len(C))])))),
            b_in=jnp.zeros((d_model,), jnp.float32),
            attn_norm=jnp.ones((L, d_model), jnp.float32),
            wq=_normal(k[1], (L, d_model, d_model), sd),
            wk=_normal(k[2], (L, d_model, d_model), sd),
            wv=_normal(k[3], (L, d_model, d_model), sd),
            wo=_normal(k[4], (L, d_model, d_model), RESID_OUT_SCALE * sd),
            mlp_norm=jnp.ones((L, d_model), jnp.float32),
            w_up=_normal(k[5], (L, d_model, d_mlp), sd),
            w_down=_normal(k[6], (L, d_mlp, d_model), RESID_OUT_SCALE * sm),
            final_norm=jnp.ones((d_model,), jnp.float32),
            w_out=layout.stack(heads),
            b_out=layout.stack({s: jnp.full((c,), LOGIT_INIT, jnp.float32) for s, c in C.items()}),
            layout=layout, sites=tuple(C), d_in=tuple(d_in[s] for s in C), C=tuple(C.values()),
            n_heads=n_heads)

    def __call__(self, site_inputs: Mapping[str, Array], components=None
                 ) -> dict[str, Float[Array, "*pos C"]]:
        """site_inputs[s]: [*batch, T, d_in[s]], or [B, d_in[s]] (each row a length-1
        sequence). Every site must have the same leading shape. Returns fp32 logits
        [*batch, T, C[s]] (resp. [B, C[s]]) per site. `components` is unused."""
        del components
        every = {g: tuple(range(len(ss))) for g, ss in self.layout.members}
        h = self.hidden(self.layout.stack(site_inputs))
        return self.layout.unstack(self.logits_of(h, every))

    def logits_of(self, h: Float[Array, "*pos d_model"], live: Mapping[str, tuple[int, ...]]
                  ) -> dict[str, Float[Array, "n *pos C"]]:
        """The logits of each group's members `live[g]` from the final hidden state, stacked:
        one batched matmul per group, traced (and compiled) once however many members."""
        return {g: jax.vmap(self.head_logits, in_axes=(None, 0))(h, self.heads(g, ix))
                for g, ix in live.items()}

    def per_site(self) -> dict[str, Array | list[Array]]:
        """The input projection and logit heads in the form before they were stacked by
        group, in the site order (`sites`): `w_in` [Σ d_in, d_model], every site's rows one
        after another, and `w_out`, `b_out` a list of each site's head. What `pdecomp
        export` writes (`older_layout` reads a checkpoint of this form back)."""
        w_in, w_out, b_out = (self.layout.unstack(x) for x in (self.w_in, self.w_out,
                                                                self.b_out))
        return {"w_in": jnp.concatenate([w_in[s] for s in self.sites]),
                "w_out": [w_out[s] for s in self.sites], "b_out": [b_out[s] for s in self.sites]}

    def heads(self, g: str, ix: tuple[int, ...]) -> tuple[Array, Array]:
        """Group g's logit heads of members `ix`: (w [n, d_model, C], b [n, C])."""
        return take((self.w_out[g], self.b_out[g]), ix, len(self.layout.of_group(g)))

    def head_logits(self, h: Float[Array, "*pos d_model"], head: tuple[Array, Array]
                    ) -> Float[Array, "*pos C"]:
        """One site's logits from its head (w [d_model, C], b [C])."""
        w, b = head
        # bf16 operands, fp32 result: the logits are compared with the 0 and 1 of the squashings
        return jnp.matmul(h, w.astype(h.dtype), preferred_element_type=jnp.float32) + b

    def hidden(self, inputs: Mapping[str, Array], remat: bool = False
               ) -> Float[Array, "*pos d_model"]:
        """The final (normed) hidden state every site's logits read, from the site inputs
        stacked by group (`inputs[g]`: [n, *batch, T, d_in] or [n, B, d_in]). `remat`: the
        backward recomputes each block from its input rather than keeping every block's
        attention scores."""
        d_in = dict(zip(self.sites, self.d_in))
        lead = None
        for g, x in inputs.items():
            d = d_in[self.layout.of_group(g)[0]]
            if x.ndim < 3 or x.shape[-1] != d or x.shape[0] != len(self.layout.of_group(g)):
                raise ValueError(f"group {g!r}: input of shape {x.shape}, expected "
                                 f"[{len(self.layout.of_group(g))}, ..., {d}]")
            if lead is not None and x.shape[1:-1] != lead:
                raise ValueError(f"site inputs must share their leading shape; got "
                                 f"{ {g: x.shape for g, x in inputs.items()} }")
            lead = x.shape[1:-1]
        no_pos = len(lead) == 1
        xs = {g: x[:, :, None, :] if no_pos else x for g, x in inputs.items()}
        dtype = jnp.result_type(*xs.values())
        # Σ over groups and members of (normed input) @ (its rows of the input linear): the
        # concatenation of every site's input times w_in, without the concatenation
        h = self.b_in.astype(dtype)
        for g, x in xs.items():
            x = rms_norm(x, jnp.ones((), x.dtype), NORM_EPS).astype(dtype)
            h = h + jnp.einsum("n...d,nde->...e", x, self.w_in[g].astype(dtype))
        cos, sin = rope_tables(rope_inv_freq(self.wq.shape[-1] // self.n_heads, ROPE_THETA),
                               h.shape[-2])
        blocks = (self.attn_norm, self.wq, self.wk, self.wv, self.wo, self.mlp_norm,
                  self.w_up, self.w_down)

        def body(h, w):
            return self._block(h, w, cos, sin), None

        h, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, h, blocks)
        h = rms_norm(h, self.final_norm.astype(dtype), NORM_EPS)
        return h[:, 0, :] if no_pos else h

    def _block(self, h: Float[Array, "*b t d"], w: tuple[Array, ...], cos: Array, sin: Array
               ) -> Array:
        attn_norm, wq, wk, wv, wo, mlp_norm, w_up, w_down = (a.astype(h.dtype) for a in w)
        n_h = self.n_heads
        d_head = h.shape[-1] // n_h
        heads = (*h.shape[:-1], n_h, d_head)
        x = rms_norm(h, attn_norm, NORM_EPS)
        # RoPE in fp32 (its cos/sin are fp32), then back to the compute dtype for the matmuls
        q = apply_rope((x @ wq).reshape(heads).astype(jnp.float32), cos, sin).astype(h.dtype)
        k = apply_rope((x @ wk).reshape(heads).astype(jnp.float32), cos, sin).astype(h.dtype)
        v = (x @ wv).reshape(heads)
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k,
                            preferred_element_type=jnp.float32) / math.sqrt(d_head)
        probs = jax.nn.softmax(scores, axis=-1).astype(h.dtype)  # no mask: bidirectional
        ctx = jnp.einsum("...hqk,...khd->...qhd", probs, v).reshape(h.shape)
        h = h + ctx @ wo
        x = rms_norm(h, mlp_norm, NORM_EPS)
        return h + jax.nn.gelu(x @ w_up) @ w_down

"""Loss terms of SPD. Every reduction is over the global batch and in fp32."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, Float, Int


def per(count: int) -> float:
    """1 / count as a Python float: a count in a traced computation is an int32 constant,
    and the sites' elements (an 8B's 13 MLP layers) or a batch's positions can pass 2^31."""
    return 1.0 / count


def p_at(step: Array | int, total_steps: int, p_start: float, p_end: float,
         start_frac: float, end_frac: float) -> Array:
    """The imp-min exponent: p_start until start_frac of training, linear to p_end at end_frac."""
    if p_start == p_end:  # a constant, which XLA folds into the power (x^1 is x, x^2 is x*x)
        return jnp.float32(p_start)
    frac = jnp.asarray(step, jnp.float32) / max(total_steps, 1)
    width = max(end_frac - start_frac, 1e-12)
    t = jnp.clip((frac - start_frac) / width, 0.0, 1.0)
    return p_start + (p_end - p_start) * t


# Importance minimality's per-value penalty ψ(ci; a, eps), `a` its annealed parameter:
# lp, (ci + eps)^p, whose gradient blows up as ci -> 0 for p < 1 (eps caps it); smooth_l0
# (Geman-McClure), ci² / (ci² + γ²), flat at 0 and of bounded gradient (|ψ'| <= 0.65 / γ),
# saturating to 1, so its sum counts active components as γ -> 0.
PENALTIES: dict[str, Callable[[Array, Array | float, float], Array]] = {
    "lp": lambda ci, p, eps: (ci + eps) ** p,
    "smooth_l0": lambda ci, gamma, eps: ci * ci / (ci * ci + gamma * gamma),
}


def importance_sums(ci_upper: Mapping[str, Float[Array, "*pos C"]], p: Array | float,
                    eps: float, members: bool = False, penalty: str = "lp"
                    ) -> dict[str, Float[Array, " C"]]:
    """S_c = Σ_pos ψ(ci) per site (`penalty`: lp, ψ = (ci + eps)^p): the only way imp-min
    sees the batch. Sums over microbatches add up to the whole batch's. `members`: each
    array is a group's, stacked over its sites ([n, *pos, C] -> [n, C])."""
    lead, psi = int(members), PENALTIES[penalty]
    return {s: jnp.sum(psi(ci.astype(jnp.float32), p, eps), axis=tuple(range(lead, ci.ndim - 1)))
            for s, ci in ci_upper.items()}


def importance_from_sums(S: Mapping[str, Float[Array, " C"]], n_pos: int, beta: float
                         ) -> Float[Array, ""]:
    """Σ_sites Σ_c m_c (1 + β log2(1 + S_c)), m_c = S_c / n_pos."""
    total = jnp.zeros((), jnp.float32)
    for v in S.values():
        total = total + jnp.sum(v * per(n_pos) * (1.0 + beta * jnp.log2(1.0 + v)))
    return total


def importance_minimality(ci_upper: Mapping[str, Float[Array, "*pos C"]], p: Array | float,
                          eps: float, beta: float, penalty: str = "lp") -> Float[Array, ""]:
    """Σ_sites Σ_c m_c (1 + β log2(1 + S_c)), S_c = Σ_pos (ci + eps)^p, m_c = S_c / n_pos.

    S_c is a sum over the whole (global) batch before the log: under jit with a sharded batch
    XLA inserts the cross-device reduction, so the value does not depend on the device count.
    """
    ci = next(iter(ci_upper.values()))
    return importance_from_sums(importance_sums(ci_upper, p, eps, penalty=penalty),
                                ci.size // ci.shape[-1], beta)


def mse(out: Array, target: Array) -> Float[Array, ""]:
    return jnp.mean((out.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)


def kl(logits: Float[Array, "*pos V"], target_logprobs: Float[Array, "*pos V"] | Logits,
       chunk: int = 0) -> Float[Array, ""]:
    """KL(softmax(clean) ‖ softmax(logits)) summed over the vocab, mean over positions, fp32.

    Takes the clean forward's log-probs (see `recon_target`), computed once per step rather
    than once per recon forward: one [*pos, V] fp32 tensor held for the step; or, as
    `Logits`, none: then the logits enter in their own dtype, kept so for the backward,
    which takes their softmax again, `chunk` positions at a time (0: all)."""
    if isinstance(target_logprobs, Logits):
        chunk = chunk or logits.shape[-2]
        return _kl_chunked(logits, jax.lax.stop_gradient(target_logprobs), chunk)
    return _kl(logits.astype(jnp.float32), target_logprobs)


@jax.custom_vjp
def _kl(logits: Array, lt: Array) -> Array:
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.mean(jnp.sum(jnp.exp(lt) * (lt - logits + lse), axis=-1))


def _kl_fwd(logits: Any, lt: Any) -> tuple[Array, tuple[Array, Array | None]]:
    # Σ p (lt − (logits − lse)) per position with its gradient in the logits, softmax − p,
    # taken in the same passes over the [*pos, V] logits and kept for the backward instead
    # of them: the vocabulary's exps once each (autodiff of log_softmax wrote the
    # log-probs, then took them again, and p twice more).
    x, t = logits.value, lt.value
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    s = jnp.sum(e, axis=-1, keepdims=True)
    p = jnp.exp(t)
    kl_terms = p * (t - x + (jnp.log(s) + jnp.max(x, axis=-1, keepdims=True)))
    n = math.prod(x.shape[:-1])
    # d/dlt = p (lt − log q + 1), when asked for (the clean target is not, in a step)
    return (jnp.sum(kl_terms) / n,
            ((e / s - p) / n, (kl_terms + p) / n if lt.perturbed else None))


def _kl_bwd(res: tuple[Array, Array | None], g: Any) -> tuple[Array | None, Array | None]:
    d_logits, d_lt = res
    if isinstance(g, SymbolicZero):
        return None, None
    return g * d_logits, None if d_lt is None else g * d_lt


_kl.defvjp(_kl_fwd, _kl_bwd, symbolic_zeros=True)


# KL and CE over chunks of the positions (`memory.logits_chunk`): every float32 [*pos, V]
# temporary is one chunk's. Chunks of the sequence axis, not of the vocabulary: a mesh
# splits the batch over its data axis and the vocabulary over its model axis, never the
# sequence, so a chunk is a slice each device holds whole (no gather).
def _rows(x: Array, i: Array, chunk: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=x.ndim - 2)


def log_normaliser(logits: Float[Array, "*pos V"], chunk: int = 0) -> Float[Array, "*pos 1"]:
    """logsumexp over the vocabulary in float32, `chunk` positions of the sequence (the
    axis before the vocabulary) at a time (0: whole)."""
    n = logits.shape[-2] // chunk if chunk else 1
    if n <= 1:
        return _lse(logits)

    def body(i, out):
        return jax.lax.dynamic_update_slice_in_dim(out, _lse(_rows(logits, i, chunk)),
                                                   i * chunk, axis=logits.ndim - 2)

    return jax.lax.fori_loop(0, n, body, jnp.zeros((*logits.shape[:-1], 1), jnp.float32))


def _kl_rows(x: Array, lse_x: Array, target: Logits, i: Array, chunk: int
             ) -> tuple[Array, Array, Array]:
    """One chunk's float32 logits, log-probs of the target, and probabilities of both."""
    xs = _rows(x, i, chunk).astype(jnp.float32)
    lt = _rows(target.logits, i, chunk).astype(jnp.float32) - _rows(target.lse, i, chunk)
    return xs, lt, jnp.exp(xs - _rows(lse_x, i, chunk))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _kl_chunked(x: Array, target: Logits, chunk: int) -> Array:
    return _kl_chunked_fwd(x, target, chunk)[0]


def _kl_chunked_fwd(x: Array, target: Logits, chunk: int) -> tuple[Array, tuple]:
    lse_x = log_normaliser(x, chunk)

    def body(i, total):
        xs, lt, _ = _kl_rows(x, lse_x, target, i, chunk)
        return total + jnp.sum(jnp.exp(lt) * (lt - xs + _rows(lse_x, i, chunk)))

    total = jax.lax.fori_loop(0, x.shape[-2] // chunk, body, jnp.zeros((), jnp.float32))
    return total / math.prod(x.shape[:-1]), (x, lse_x, target)


def _kl_chunked_bwd(chunk: int, res: tuple, g: Array) -> tuple[Array, None]:
    # softmax(x) − p, a chunk at a time into the logits' cotangent (their dtype: what the
    # head's backward takes); the target is a constant of every caller.
    x, lse_x, target = res
    n = math.prod(x.shape[:-1])

    def body(i, dx):
        _, lt, q = _kl_rows(x, lse_x, target, i, chunk)
        return jax.lax.dynamic_update_slice_in_dim(
            dx, (g * (q - jnp.exp(lt)) / n).astype(x.dtype), i * chunk, axis=x.ndim - 2)

    dx = jax.lax.fori_loop(0, x.shape[-2] // chunk, body, jnp.zeros_like(x))
    return dx, None


_kl_chunked.defvjp(_kl_chunked_fwd, _kl_chunked_bwd)


class Logits(NamedTuple):
    """Log-probs kept as the logits they are taken from, in the logits' dtype, with their
    float32 log-normaliser (`memory.logits_chunk`): each use takes the float32 log-probs a
    chunk of positions at a time, so no [*pos, V] float32 tensor is held (an 8B's two
    largest buffers were its recon target's, 4.2 GB each at 16 x 512 tokens)."""

    logits: Array  # [*pos, V]
    lse: Array  # [*pos, 1], float32


def recon_target(distance: str, clean: Array, chunk: int = 0) -> Array | Logits:
    """What each recon forward's output is compared with: the clean output (mse) or its
    fp32 log-probs (kl), whole, or as `Logits` when taken `chunk` positions at a time."""
    if distance != "kl":
        return clean
    # The logits whole before their log-softmax: XLA:CPU fused the row maximum into the
    # head's matmul, which then ran at 190 GFLOP/s against the masked head's 240 (the
    # SmolLM2 step 1.6-3.1% faster without it: back-to-back pairs in bench/RESULTS.md).
    clean = jax.lax.optimization_barrier(clean)
    if chunk:
        return Logits(clean, log_normaliser(clean, chunk))
    return jax.nn.log_softmax(clean.astype(jnp.float32), axis=-1)


def cross_entropy(logits: Float[Array, "b t V"], tokens: Array, chunk: int = 0
                  ) -> Float[Array, ""]:
    """Next-token CE (nats), mean over the positions that have a next token, fp32, from
    the log-normaliser (`chunk` positions at a time) and the next tokens' logits."""
    lse = log_normaliser(logits, chunk)[:, :-1]
    return next_token_nll(Logits(logits[:, :-1], lse), tokens)


def _lse(logits: Array) -> Array:
    return jax.nn.logsumexp(logits.astype(jnp.float32), -1, keepdims=True)


def next_token_nll(logprobs: Float[Array, "b s V"] | Logits, tokens: Int[Array, "b t"]
                   ) -> Float[Array, ""]:
    """`cross_entropy` from log-probs already taken, whole or as `Logits`: those of the
    positions that have a next token (a KL target's, sliced `[:, :-1]`)."""
    nxt = tokens[:, 1:, None]
    if isinstance(logprobs, Logits):
        picked = jnp.take_along_axis(logprobs.logits, nxt, axis=-1).astype(jnp.float32)
        return -jnp.mean(picked - logprobs.lse)
    return -jnp.mean(jnp.take_along_axis(logprobs, nxt, axis=-1))


DISTANCES = {"mse": mse, "kl": kl}


def distance(name: str, chunk: int = 0) -> Callable[[Array, Any], Array]:
    """The output distance `name` (one of DISTANCES), a KL taken `chunk` positions at a time."""
    return partial(kl, chunk=chunk) if name == "kl" else DISTANCES[name]

"""Loss terms of SPD. Every reduction is over the global batch and in fp32."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

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


def kl(logits: Float[Array, "*pos V"], target_logprobs: Float[Array, "*pos V"]
       ) -> Float[Array, ""]:
    """KL(softmax(clean) ‖ softmax(logits)) summed over the vocab, mean over positions, fp32.

    Takes the clean forward's log-probs (see `recon_target`), computed once per step rather
    than once per recon forward: one [*pos, V] fp32 tensor held for the step."""
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


def recon_target(distance: str, clean: Array) -> Array:
    """What each recon forward's output is compared with: the clean output (mse) or its
    fp32 log-probs (kl)."""
    if distance != "kl":
        return clean
    # The logits whole before their log-softmax: XLA:CPU fused the row maximum into the
    # head's matmul, which then ran at 190 GFLOP/s against the masked head's 240 (the
    # SmolLM2 step 1.6-3.1% faster without it: back-to-back pairs in bench/RESULTS.md).
    clean = jax.lax.optimization_barrier(clean)
    return jax.nn.log_softmax(clean.astype(jnp.float32), axis=-1)


def cross_entropy(logits: Float[Array, "b t V"], tokens: Array) -> Float[Array, ""]:
    """Next-token CE (nats), mean over the positions that have a next token, fp32."""
    return next_token_nll(jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1),
                          tokens)


def next_token_nll(logprobs: Float[Array, "b s V"], tokens: Int[Array, "b t"]
                   ) -> Float[Array, ""]:
    """`cross_entropy` from log-probs already taken: those of the positions that have a next
    token (a KL target's, sliced `[:, :-1]`)."""
    return -jnp.mean(jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1))


DISTANCES = {"mse": mse, "kl": kl}

"""The adversary's sources and their ascent: what persistent PGD trains (`train`) and what
the fresh PGD of the final evaluation draws anew (`metrics`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array


class Adversary(eqx.Module):
    """Persistent PGD sources per site, shaped by their scope ([1|B, 1|T, C+1]), in [0, 1],
    and their ascent optimizer's moments."""

    sources: dict[str, Array]
    opt: optax.OptState


_PGD_ADAM = optax.scale_by_adam(b1=0.5, b2=0.99, eps=1e-8)
# The adversary's ascent by name (`loss.pgd.optimizer`): (gradients, its moments) -> (the
# direction, the moments after). sign: the gradients' signs; adam: Adam's step.
PGD_OPTIMIZERS: dict[str, Callable[[dict, optax.OptState], tuple[dict, optax.OptState]]] = {
    "adam": lambda grads, opt: _PGD_ADAM.update(grads, opt),
    "sign": lambda grads, opt: (jax.tree.map(jnp.sign, grads), opt),
}


def ascend(adv: Adversary, grads: Mapping[str, Array], lr: Array, kind: str) -> Adversary:
    """One ascent step on the sources (maximising D), then clamp to [0, 1]."""
    direction, opt = PGD_OPTIMIZERS[kind](dict(grads), adv.opt)
    sources = jax.tree.map(lambda s, d: jnp.clip(s + lr * d, 0.0, 1.0), adv.sources, direction)
    return Adversary(sources, opt)


def fresh(sources: dict[str, Array]) -> Adversary:
    """Sources that start their ascent: Adam's moments at zero (unused by sign steps)."""
    return Adversary(sources, _PGD_ADAM.init(sources))

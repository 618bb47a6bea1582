"""The loss terms measured on masked forwards, each a name, a coefficient and a function.

Faithfulness (the weights alone, once per step) and importance minimality (the CI's sums
over the whole batch) are the method's frame, and the step computes them itself. Every
other term is one `Term` here, made once from the run's `loss` group by `of`: the step
sums `coeff x value` over `Method.terms` and logs each as `loss/<name>`, so a new term is
one function and one line of `of`, beside its field in `pdecomp.core.config.LossConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
from jaxtyping import Array

from pdecomp.core.config import LossConfig
from pdecomp.spd.components import Components
from pdecomp.spd.masks import Plan, Positions, make_plan


class Microbatch(NamedTuple):
    """What a term reads of one microbatch, inside the step's one backward (the step's
    types are named, not imported: the step imports this module)."""

    forwards: Any  # the step's `Pass`: its masked forwards (`recon_distance`, `pgd_distance`)
    components: Components  # as the forwards use them: tied followers built
    ci: Any  # ci_lower by group; (CI function, its features) when the step streams its CI
    sources: dict[str, Array] | None  # the persistent adversary's, for the whole batch
    observed: Any  # the step's `Observed`: the clean forward's record of the microbatch
    m: Array | int  # the microbatch's number
    at: Positions | None  # where the microbatch sits in the batch (None: the whole batch)


@dataclass(frozen=True)
class Term:
    """`value(microbatch, key)`: the term's mean over the microbatch's positions. Only a
    `random` term is given a key of its own (None otherwise): a deterministic one changes
    no other term's draws."""

    name: str
    coeff: float
    value: Callable[[Microbatch, Array | None], Array]
    random: bool = True


@dataclass(frozen=True)
class StochasticRecon:
    """The mean over the plan's forwards of D(forward with the plan's sites masked, clean):
    masks from `source`, routed to positions by `routing` (`pdecomp.spd.masks`)."""

    plan: Plan
    source: str
    routing: str

    def __call__(self, mb: Microbatch, key: Array) -> Array:
        keys = jax.random.split(key, len(self.plan))
        ds = [mb.forwards.recon_distance(live, self.source, self.routing, mb.components,
                                         mb.ci, k, mb.observed, mb.at)
              for live, k in zip(self.plan, keys)]
        return sum(ds) / len(ds)


def adversarial_recon(mb: Microbatch, key: None) -> Array:
    """D(every site masked by the persistent adversary's sources, clean)."""
    rows = {s: mb.forwards.source_rows(v, mb.m) for s, v in mb.sources.items()}
    return mb.forwards.pgd_distance(mb.components, mb.ci, rows, mb.observed)


def of(loss: LossConfig, sites: tuple[str, ...]) -> tuple[Term, ...]:
    """The run's terms, in the order their keys are drawn; a zero coefficient switches one
    off."""
    out = [Term(f"recon_{name}", t.coeff,
                StochasticRecon(make_plan(t.plan, sites, t.sites_per_chunk), t.source,
                                t.routing))
           for name, t in loss.recon.items() if t.coeff > 0]
    if loss.pgd.coeff > 0:
        out.append(Term("pgd", loss.pgd.coeff, adversarial_recon, random=False))
    return tuple(out)

"""One SPD training step, top to bottom, over explicit state.

    state, metrics = train_step(state, target, batch)

1. clean forward of the frozen target (every site on the frozen path), recording each
   site's input; its output is the recon target, under stop-gradient;
2. CI function on those site inputs → logits → ci_lower (masks) and ci_upper (imp-min);
3. loss = faithfulness + imp-min(p(step)) + Σ coeff · mean over each plan's forwards of
   D(masked forward, clean);
4. one backward; AdamW on components (global-norm clipped) and on the CI function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, PRNGKeyArray

from pdecomp import losses
from pdecomp.ci import CIFunction, ci_lower, ci_upper
from pdecomp.components import Components, masked_linear, recording_linear, with_tied
from pdecomp.config import OptGroupConfig, RunConfig, site_C, tied_sites
from pdecomp.masks import Plan, make_plan, sample_forward_masks


class TrainState(eqx.Module):
    """Everything that changes during training. The frozen target is not part of it."""

    step: Array
    components: Components
    ci_fn: CIFunction
    comp_opt: optax.OptState
    ci_opt: optax.OptState
    key: Array  # raw uint32 PRNG key, so checkpoints hold plain arrays


@dataclass(frozen=True)
class ReconTerm:
    name: str
    coeff: float
    plan: Plan
    source: str
    routing: str


@dataclass(frozen=True)
class StepSpec:
    """The static (hashable) part of a step, derived from a RunConfig."""

    sites: tuple[str, ...]
    tied: tuple[tuple[str, str], ...]  # (follower, leader)
    delta: bool
    recon: tuple[ReconTerm, ...]
    distance: str
    faith_coeff: float
    imp_coeff: float
    p: tuple[float, float, float, float]  # start, end, start_frac, end_frac
    beta: float
    eps: float
    total_steps: int
    compute_dtype: str

    @staticmethod
    def from_config(cfg: RunConfig) -> StepSpec:
        sites = tuple(site_C(cfg))
        lo = cfg.loss
        recon = tuple(ReconTerm(n, t.coeff, make_plan(t.plan, sites, t.sites_per_chunk),
                                t.source, t.routing) for n, t in lo.recon.items()
                      if t.coeff > 0)  # a zero coefficient switches a term off
        tied = tuple(tied_sites(cfg).items())
        return StepSpec(sites, tied, cfg.layers.delta, recon, lo.distance, lo.faithfulness_coeff,
                        lo.imp_min_coeff, (lo.p_start, lo.p_end, lo.p_anneal_start_frac,
                                           lo.p_anneal_end_frac), lo.beta, lo.eps,
                        cfg.optim.steps, cfg.memory.compute_dtype)


def schedule(g: OptGroupConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup over warmup_frac, then constant / linear / cosine to final_frac × lr."""
    warm = round(g.warmup_frac * total_steps)
    rest = max(total_steps - warm, 1)
    end = g.lr * g.final_frac
    if g.schedule == "constant":
        decay = optax.constant_schedule(g.lr)
    elif g.schedule == "linear":
        decay = optax.linear_schedule(g.lr, end, rest)
    else:
        decay = optax.cosine_decay_schedule(g.lr, rest, alpha=g.final_frac)
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, g.lr, warm), decay], [warm])


def optimizer(g: OptGroupConfig, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(schedule(g, total_steps), g.b1, g.b2, g.eps, weight_decay=g.weight_decay)
    return optax.chain(optax.clip_by_global_norm(g.clip_norm), adamw) if g.clip_norm else adamw


def site_shapes(target) -> dict[str, tuple[int, int]]:
    return {s: tuple(W.shape) for s, W in target.site_weights().items()}


def init_state(key: PRNGKeyArray, cfg: RunConfig, target) -> TrainState:
    """Fresh components and CI function for `target` (pure: usable under eval_shape)."""
    C = site_C(cfg)
    shapes = site_shapes(target)
    k_comp, k_ci, k_run = jax.random.split(key, 3)
    own = {s: c for s, c in C.items() if s not in tied_sites(cfg)}  # followers own nothing
    components = Components.init(k_comp, shapes, own)
    ci_fn = CIFunction.init(k_ci, cfg.layers.ci_fn, {s: shapes[s][0] for s in C}, C,
                            list(cfg.layers.ci_hidden))
    return TrainState(
        step=jnp.zeros((), jnp.int32), components=components, ci_fn=ci_fn,
        comp_opt=optimizer(cfg.optim.components, cfg.optim.steps).init(components),
        ci_opt=optimizer(cfg.optim.ci_fn, cfg.optim.steps).init(ci_fn), key=k_run)


def faithfulness_warmup(cfg: RunConfig, components: Components, target) -> Components:
    """AdamW on faithfulness alone before step 0, so V@U starts near W; the optimizer is
    discarded afterwards."""
    o = cfg.optim
    if o.faith_warmup_steps == 0:
        return components
    opt = optax.adamw(o.faith_warmup_lr, weight_decay=o.faith_warmup_weight_decay)
    tied = tied_sites(cfg)
    sites = set(site_C(cfg))
    weights = {s: W for s, W in target.site_weights().items() if s in sites}

    def faith(comps):
        return losses.faithfulness(weights, with_tied(comps, tied))

    @jax.jit
    def run(components):
        def body(_, carry):
            comps, opt_state = carry
            grads = jax.grad(faith)(comps)
            updates, opt_state = opt.update(grads, opt_state, comps)
            return optax.apply_updates(comps, updates), opt_state

        comps, _ = jax.lax.fori_loop(0, o.faith_warmup_steps, body,
                                     (components, opt.init(components)))
        return comps

    return run(components)


def make_train_step(cfg: RunConfig) -> Callable:
    """The pure train step for `cfg`: (state, target, batch) -> (state, metrics)."""
    spec = StepSpec.from_config(cfg)
    comp_opt = optimizer(cfg.optim.components, cfg.optim.steps)
    ci_opt = optimizer(cfg.optim.ci_fn, cfg.optim.steps)
    distance = losses.DISTANCES[spec.distance]
    dtype = jnp.dtype(spec.compute_dtype)
    threshold = cfg.loss.ci_threshold

    def loss_fn(params, target, batch, key, step):
        own_components, ci_fn = params
        components = with_tied(own_components, dict(spec.tied))
        x = batch.astype(dtype)
        # 1. Clean forward: the recon target and the CI function's inputs.
        site_inputs: dict[str, Array] = {}
        clean = jax.lax.stop_gradient(target(x, recording_linear(site_inputs)))
        site_inputs = jax.lax.stop_gradient({s: site_inputs[s] for s in spec.sites})
        # 2. Causal importances.
        logits = ci_fn(site_inputs, components)
        lower = {s: ci_lower(v) for s, v in logits.items()}
        upper = {s: ci_upper(v) for s, v in logits.items()}
        # 3. Losses.
        p = losses.p_at(step, spec.total_steps, *spec.p)
        terms = {
            "faithfulness": losses.faithfulness(target.site_weights(), components),
            "imp_min": losses.importance_minimality(upper, p, spec.eps, spec.beta),
        }
        total = spec.faith_coeff * terms["faithfulness"] + spec.imp_coeff * terms["imp_min"]
        term_keys = jax.random.split(key, max(len(spec.recon), 1))
        for term, term_key in zip(spec.recon, term_keys):
            fwd_keys = jax.random.split(term_key, len(term.plan))
            ds = []
            for live, fwd_key in zip(term.plan, fwd_keys):
                masks = sample_forward_masks(fwd_key, live, term.source, term.routing, lower,
                                             spec.delta)
                ds.append(distance(target(x, masked_linear(components, masks)), clean))
            terms[f"recon_{term.name}"] = sum(ds) / len(ds)
            total = total + term.coeff * terms[f"recon_{term.name}"]
        terms["total"] = total
        l0 = {s: jnp.mean(jnp.sum(v > threshold, axis=-1).astype(jnp.float32))
              for s, v in lower.items()}
        return total, (terms, l0, p)

    def train_step(state: TrainState, target, batch: Array) -> tuple[TrainState, dict]:
        key, step_key = jax.random.split(state.key)
        params = (state.components, state.ci_fn)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, (terms, l0, p)), (g_comp, g_ci) = grad_fn(params, target, batch, step_key,
                                                      state.step)
        # 4. Separate optimizers: components clipped and scheduled apart from the CI fn.
        upd, comp_state = comp_opt.update(g_comp, state.comp_opt, state.components)
        components = optax.apply_updates(state.components, upd)
        upd, ci_state = ci_opt.update(g_ci, state.ci_opt, state.ci_fn)
        ci_fn = optax.apply_updates(state.ci_fn, upd)
        metrics = {**{f"loss/{k}": v for k, v in terms.items()},
                   **{f"train/l0/{s}": v for s, v in l0.items()},
                   "train/p": p, "train/grad_norm/components": optax.tree.norm(g_comp)}
        new = TrainState(state.step + 1, components, ci_fn, comp_state, ci_state, key)
        return new, metrics

    return train_step

"""One SPD training step, top to bottom, over explicit state.

    state, metrics = train_step(state, target, batch)

1. outside every gradient graph: the prefix (the layers before the first site; LMs) runs
   once, then the clean forward (every site frozen) records each site's input; its output
   is the recon target;
2. CI function on those site inputs → logits → ci_lower (masks) and ci_upper (imp-min);
3. the persistent adversary's warmup ascents (components and CI detached);
4. loss = faithfulness + imp-min(p(step)) + Σ coeff · mean over each plan's forwards of
   D(masked forward, clean) + coeff · D(adversarial forward, clean);
5. one backward; AdamW on components (global-norm clipped) and on the CI function; one
   more ascent of the adversary's sources with their gradient from that backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, PRNGKeyArray

from pdecomp import losses
from pdecomp.ci import CIFunction, ci_lower, ci_upper
from pdecomp.components import (
    Components,
    fold_tied,
    masked_linear,
    recording_linear,
    weight_deltas,
    with_tied,
)
from pdecomp.config import OptGroupConfig, PGDConfig, RunConfig, site_C, tied_sites
from pdecomp.masks import Plan, make_plan, masks_from_sources, sample_forward_masks


class Adversary(eqx.Module):
    """Persistent PGD sources per site, shaped by their scope ([1|B, 1|T, C+1]), in [0, 1],
    and their ascent optimizer's moments."""

    sources: dict[str, Array]
    opt: optax.OptState


class TrainState(eqx.Module):
    """Everything that changes during training. The frozen target is not part of it."""

    step: Array
    components: Components
    ci_fn: CIFunction
    comp_opt: optax.OptState
    ci_opt: optax.OptState
    adversary: Adversary | None  # None: no persistent PGD term
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
    pgd: PGDConfig | None  # None: off
    distance: str
    faith_coeff: float
    imp_coeff: float
    p: tuple[float, float, float, float]  # start, end, start_frac, end_frac
    beta: float
    eps: float
    total_steps: int
    compute_dtype: str
    remat: str
    remat_names: tuple[str, ...]

    @staticmethod
    def from_config(cfg: RunConfig) -> StepSpec:
        sites = tuple(site_C(cfg))
        lo = cfg.loss
        recon = tuple(ReconTerm(n, t.coeff, make_plan(t.plan, sites, t.sites_per_chunk),
                                t.source, t.routing) for n, t in lo.recon.items()
                      if t.coeff > 0)  # a zero coefficient switches a term off
        tied = tuple(tied_sites(cfg).items())
        return StepSpec(sites, tied, cfg.layers.delta, recon,
                        lo.pgd if lo.pgd.coeff > 0 else None, lo.distance,
                        lo.faithfulness_coeff, lo.imp_min_coeff,
                        (lo.p_start, lo.p_end, lo.p_anneal_start_frac, lo.p_anneal_end_frac),
                        lo.beta, lo.eps, cfg.optim.steps, cfg.memory.compute_dtype,
                        cfg.memory.remat, tuple(cfg.memory.remat_names))


def remat_policy(kind: str, names: Sequence[str]) -> Callable | None | bool:
    """The `jax.checkpoint` policy of a recon forward; False: no rematerialization."""
    cp = jax.checkpoint_policies
    if kind == "none":
        return False
    if kind == "full":
        return None  # save nothing but the inputs
    if kind == "save_dots":
        return cp.dots_with_no_batch_dims_saveable
    if kind == "names":
        return cp.save_only_these_names(*names)
    if kind == "offload":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
            offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"unknown remat {kind!r}")


def pgd_source_shape(scope: str, pos: tuple[int, ...], C: int) -> tuple[int, ...]:
    """global: one source for everything; batch_shared: one per position, shared by the
    batch's examples; per_example: one per example and position."""
    if scope == "global":
        return (*(1 for _ in pos), C + 1)
    if scope == "batch_shared":
        return (1, *pos[1:], C + 1)
    if scope == "per_example":
        return (*pos, C + 1)
    raise ValueError(f"unknown scope {scope!r}")


def batch_positions(cfg: RunConfig) -> tuple[int, ...]:
    """The leading (position) shape of site inputs: [B] for toys, [B, T] for LMs."""
    B = cfg.data.batch_size
    return (B, cfg.data.seq_len) if cfg.model.kind == "llama" else (B,)


def pgd_lr(pgd: PGDConfig, total_steps: int) -> optax.Schedule:
    return schedule(OptGroupConfig(lr=pgd.lr, schedule="constant",
                                   warmup_frac=pgd.warmup_frac), total_steps)


_PGD_ADAM = optax.scale_by_adam(b1=0.5, b2=0.99, eps=1e-8)


def ascend(adv: Adversary, grads: Mapping[str, Array], lr: Array, kind: str) -> Adversary:
    """One ascent step on the sources (maximising D), then clamp to [0, 1]."""
    if kind == "sign":
        direction, opt = jax.tree.map(jnp.sign, dict(grads)), adv.opt
    else:
        direction, opt = _PGD_ADAM.update(dict(grads), adv.opt)
    sources = jax.tree.map(lambda s, d: jnp.clip(s + lr * d, 0.0, 1.0), adv.sources, direction)
    return Adversary(sources, opt)


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


def optimized_components(cfg: RunConfig, components: Components) -> Components:
    """What the components' optimizer steps: the owned sites, or with a per-site tied
    update (`layers.tie_update`) every site, followers as their leaders' transposes."""
    if cfg.layers.tie_update == "per_site":
        return with_tied(components, tied_sites(cfg))
    return components


def apply_component_updates(cfg: RunConfig, components: Components,
                            updates: Components) -> Components:
    """Optimizer updates (shaped like `optimized_components`) applied to the owned sites."""
    return optax.apply_updates(components, fold_tied(updates, tied_sites(cfg)))


def init_state(key: PRNGKeyArray, cfg: RunConfig, target) -> TrainState:
    """Fresh components and CI function for `target` (pure: usable under eval_shape)."""
    C = site_C(cfg)
    shapes = site_shapes(target)
    k_comp, k_ci, k_run = jax.random.split(key, 3)
    own = {s: c for s, c in C.items() if s not in tied_sites(cfg)}  # followers own nothing
    components = Components.init(k_comp, shapes, own)
    ci_fn = CIFunction.init(k_ci, cfg.layers, {s: shapes[s][0] for s in C}, C)
    adversary = None
    if cfg.loss.pgd.coeff > 0:
        k_run, k_adv = jax.random.split(k_run)
        pos = batch_positions(cfg)
        keys = jax.random.split(k_adv, len(C))
        sources = {s: jax.random.uniform(k, pgd_source_shape(cfg.loss.pgd.scope, pos, c))
                   for k, (s, c) in zip(keys, C.items())}
        adversary = Adversary(sources, _PGD_ADAM.init(sources))
    return TrainState(
        step=jnp.zeros((), jnp.int32), components=components, ci_fn=ci_fn,
        comp_opt=optimizer(cfg.optim.components, cfg.optim.steps).init(
            optimized_components(cfg, components)),
        ci_opt=optimizer(cfg.optim.ci_fn, cfg.optim.steps).init(ci_fn), adversary=adversary,
        key=k_run)


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

    def faith(comps, weights):
        return losses.faithfulness(weight_deltas(weights, with_tied(comps, tied)))

    # The weights are an argument, not a closure: a closed-over array becomes a constant in
    # the program (a copy of the target's weights), and one split across processes cannot.
    @jax.jit
    def run(components, weights):
        def body(_, carry):
            comps, opt_state = carry
            stepped = optimized_components(cfg, comps)
            updates, opt_state = opt.update(jax.grad(faith)(stepped, weights), opt_state,
                                            stepped)
            return apply_component_updates(cfg, comps, updates), opt_state

        init = opt.init(optimized_components(cfg, components))
        comps, _ = jax.lax.fori_loop(0, o.faith_warmup_steps, body, (components, init))
        return comps

    return run(components, weights)


def make_train_step(cfg: RunConfig) -> Callable:
    """The pure train step for `cfg`: (state, target, batch) -> (state, metrics)."""
    spec = StepSpec.from_config(cfg)
    comp_opt = optimizer(cfg.optim.components, cfg.optim.steps)
    ci_opt = optimizer(cfg.optim.ci_fn, cfg.optim.steps)
    distance = losses.DISTANCES[spec.distance]
    dtype = jnp.dtype(spec.compute_dtype)
    threshold = cfg.loss.ci_threshold
    policy = remat_policy(spec.remat, spec.remat_names)
    lr_pgd = pgd_lr(spec.pgd, spec.total_steps) if spec.pgd else None

    def train_step(state: TrainState, target, batch: Array) -> tuple[TrainState, dict]:
        key, step_key = jax.random.split(state.key)
        prefix, suffix = target.split(spec.sites, dtype)

        # 1. Outside every gradient graph: the residual start, then the clean forward,
        # which gives the recon target and the CI function's inputs.
        resid = jax.lax.stop_gradient(prefix(batch))
        recorded: dict[str, Array] = {}
        streams: dict[int, Array] = {}  # LMs: the residual entering each site layer
        clean = suffix(resid, recording_linear(recorded), streams=streams)
        site_inputs = jax.lax.stop_gradient({s: recorded[s] for s in spec.sites})
        streams = jax.lax.stop_gradient(streams)
        recon_target = jax.lax.stop_gradient(losses.recon_target(spec.distance, clean))

        def forward_distance(components: Components, deltas: dict, masks: dict,
                             streams: dict, recon_target: Array) -> Array:
            # A forward starts at its first live layer, from the clean stream there.
            out = suffix(resid, masked_linear(components, masks, deltas), streams=streams,
                         live=tuple(masks))
            return distance(out, recon_target)

        if policy is not False:  # rematerialize: the backward reruns each forward
            forward_distance = jax.checkpoint(forward_distance, policy=policy)

        def pgd_distance(components, deltas, lower, sources):
            masks = masks_from_sources(lower, sources, {s: None for s in sources}, spec.delta)
            return forward_distance(components, deltas, masks, streams, recon_target)

        # 3. The adversary's warmup ascents, against detached components and CI (a loop,
        # not unrolled: one compiled ascent however many there are).
        adversary = state.adversary
        if spec.pgd:
            lr = lr_pgd(state.step)
            comps = jax.lax.stop_gradient(with_tied(state.components, dict(spec.tied)))
            deltas = jax.lax.stop_gradient(weight_deltas(target.site_weights(), comps))
            lower = jax.lax.stop_gradient({s: ci_lower(v) for s, v in
                                           state.ci_fn(site_inputs, comps).items()})

            def warmup_ascent(_, adv):
                g = jax.grad(lambda src: pgd_distance(comps, deltas, lower, src))(adv.sources)
                return ascend(adv, g, lr, spec.pgd.optimizer)

            adversary = jax.lax.fori_loop(0, spec.pgd.n_warmup, warmup_ascent, adversary)

        def loss_fn(params, key, step):
            stepped_components, ci_fn, sources = params
            # Shared tied update: the followers are built here, so both sites' gradients
            # sum on the owned parameters. Per-site: they came in with the stepped
            # components (optimized_components), with gradients of their own.
            components = with_tied(stepped_components, dict(spec.tied))
            # 2. Causal importances.
            logits = ci_fn(site_inputs, components)
            lower = {s: ci_lower(v) for s, v in logits.items()}
            upper = {s: ci_upper(v) for s, v in logits.items()}
            # 4. Losses.
            p = losses.p_at(step, spec.total_steps, *spec.p)
            deltas = weight_deltas(target.site_weights(), components)
            terms = {
                "faithfulness": losses.faithfulness(deltas),
                "imp_min": losses.importance_minimality(upper, p, spec.eps, spec.beta),
            }
            total = spec.faith_coeff * terms["faithfulness"] + spec.imp_coeff * terms["imp_min"]
            term_keys = jax.random.split(key, max(len(spec.recon), 1))
            for term, term_key in zip(spec.recon, term_keys):
                fwd_keys = jax.random.split(term_key, len(term.plan))
                ds = []
                for live, fwd_key in zip(term.plan, fwd_keys):
                    masks = sample_forward_masks(fwd_key, live, term.source, term.routing,
                                                 lower, spec.delta)
                    ds.append(forward_distance(components, deltas, masks, streams,
                                               recon_target))
                terms[f"recon_{term.name}"] = sum(ds) / len(ds)
                total = total + term.coeff * terms[f"recon_{term.name}"]
            if spec.pgd:
                terms["pgd"] = pgd_distance(components, deltas, lower, sources)
                total = total + spec.pgd.coeff * terms["pgd"]
            terms["total"] = total
            l0 = {s: jnp.mean(jnp.sum(v > threshold, axis=-1).astype(jnp.float32))
                  for s, v in lower.items()}
            return total, (terms, l0, p)

        sources = adversary.sources if adversary is not None else None
        params = (optimized_components(cfg, state.components), state.ci_fn, sources)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, (terms, l0, p)), (g_comp, g_ci, g_src) = grad_fn(params, step_key, state.step)
        # 5. Separate optimizers: components clipped and scheduled apart from the CI fn; the
        # sources ascend on their own gradient, unscaled by the term's coefficient.
        upd, comp_state = comp_opt.update(g_comp, state.comp_opt, params[0])
        components = apply_component_updates(cfg, state.components, upd)
        upd, ci_state = ci_opt.update(g_ci, state.ci_opt, state.ci_fn)
        ci_fn = optax.apply_updates(state.ci_fn, upd)
        if spec.pgd:
            g_src = jax.tree.map(lambda g: g / spec.pgd.coeff, g_src)
            adversary = ascend(adversary, g_src, lr, spec.pgd.optimizer)
        metrics = {**{f"loss/{k}": v for k, v in terms.items()},
                   **{f"train/l0/{s}": v for s, v in l0.items()},
                   "train/p": p, "train/grad_norm/components": optax.tree.norm(g_comp)}
        new = TrainState(step=state.step + 1, components=components, ci_fn=ci_fn,
                         comp_opt=comp_state, ci_opt=ci_state, adversary=adversary, key=key)
        return new, metrics

    return train_step

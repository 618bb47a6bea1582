"""One SPD training step, top to bottom, over explicit state.

    state, metrics = train_step(state, target, batch)

1. outside every gradient graph: the prefix (the layers before the first site; LMs) runs
   once, then the clean forward (every site frozen) records each site's input; its output
   is the recon target;
2. CI function on those site inputs → logits → ci_lower (masks) and ci_upper (imp-min);
3. the persistent adversary's warmup ascents (components and CI detached);
4. loss = faithfulness + imp-min(p(step)) + Σ coeff · value over the method's terms on
   masked forwards (`terms`: each recon plan's mean D(masked forward, clean), the
   adversary's D(adversarial forward, clean));
5. one backward; AdamW on components (global-norm clipped) and on the CI function; one
   more ascent of the adversary's sources with their gradient from that backward.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial, reduce
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, PRNGKeyArray

from pdecomp.core.config import LayersConfig, OptGroupConfig, OptimConfig, PGDConfig
from pdecomp.core.memory import MemoryPolicy
from pdecomp.core.sharding import DEVICE, HOST, Layout, move
from pdecomp.spd import adversary as adversary_lib
from pdecomp.spd import losses
from pdecomp.spd.adversary import Adversary, ascend
from pdecomp.spd.ci import CIFunction, ci_lower, ci_upper
from pdecomp.spd.components import (
    Components,
    Groups,
    MaskParts,
    Recorded,
    faithfulness_into,
    fold_tied,
    from_parts,
    recording_linear,
    take,
    weight_stacks,
    with_tied,
)
from pdecomp.spd.masks import Positions, group_parts, pgd_source_shape
from pdecomp.spd.terms import Microbatch, Term


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
class Sites:
    """The decomposed sites in order, their components, and their tying."""

    names: tuple[str, ...]
    C: tuple[int, ...]  # components per site, in the order of `names`
    tied: tuple[tuple[str, str], ...]  # (follower, leader)
    tie_update: str  # a name in TIE_UPDATES


@dataclass(frozen=True)
class Method:
    """What the loss is made of: the CI function, the terms and their settings."""

    ci: LayersConfig  # the CI function's settings (`layers.ci_*`)
    delta: bool
    terms: tuple[Term, ...]  # the terms on masked forwards (`pdecomp.spd.terms`)
    pgd: PGDConfig | None  # the persistent adversary's settings (None: no adversary)
    distance: str
    faith_coeff: float
    imp_coeff: float
    p: tuple[float, float, float, float]  # the penalty's p (or γ): start, end, fracs
    beta: float
    eps: float
    penalty: str  # importance minimality's per-value penalty (losses.PENALTIES)
    ci_threshold: float


@dataclass(frozen=True)
class StepSpec:
    """What training reads of a run (`pdecomp.plan.resolve.step_spec` makes it): the decomposed
    sites, the method, the memory plan, the optimizers' settings and the batch's shape.
    Everything in this module takes it, not the config."""

    sites: Sites
    method: Method
    memory: MemoryPolicy
    optim: OptimConfig
    total_steps: int
    microbatches: int
    positions: tuple[int, ...]  # a whole batch's positions (the adversary's sources)

    @property
    def site_C(self) -> dict[str, int]:
        return dict(zip(self.sites.names, self.sites.C))


def pgd_lr(pgd: PGDConfig, total_steps: int) -> optax.Schedule:
    return schedule(OptGroupConfig(lr=pgd.lr, schedule="constant",
                                   warmup_frac=pgd.warmup_frac), total_steps)


# The learning-rate decays by name (`optim.<group>.schedule`): (lr, final_frac, steps) ->
# a schedule from lr to final_frac x lr.
SCHEDULES: dict[str, Callable[[float, float, int], optax.Schedule]] = {
    "constant": lambda lr, final, n: optax.constant_schedule(lr),
    "linear": lambda lr, final, n: optax.linear_schedule(lr, lr * final, n),
    "cosine": lambda lr, final, n: optax.cosine_decay_schedule(lr, n, alpha=final),
}


def schedule(g: OptGroupConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup over warmup_frac, then the decay of `g.schedule` to final_frac × lr."""
    warm = round(g.warmup_frac * total_steps)
    decay = SCHEDULES[g.schedule](g.lr, g.final_frac, max(total_steps - warm, 1))
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, g.lr, warm), decay], [warm])


def optimizer(g: OptGroupConfig, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(schedule(g, total_steps), g.b1, g.b2, g.eps, weight_decay=g.weight_decay)
    return optax.chain(optax.clip_by_global_norm(g.clip_norm), adamw) if g.clip_norm else adamw


class Optimizers(NamedTuple):
    """The two optimizers of a step: the components' and the CI function's."""

    components: optax.GradientTransformation
    ci_fn: optax.GradientTransformation

    @staticmethod
    def of(optim: OptimConfig) -> Optimizers:
        """`optim.components` and `optim.ci_fn`: AdamW on their schedules, clipped."""
        return Optimizers(optimizer(optim.components, optim.steps),
                          optimizer(optim.ci_fn, optim.steps))


def site_shapes(target) -> dict[str, tuple[int, int]]:
    return {s: tuple(W.shape) for s, W in target.site_weights().items()}


def site_groups(spec: StepSpec, shapes: Mapping[str, tuple[int, int]]) -> Groups:
    """The state's groups: the sites of one kind, shape and C stacked over their layers; a
    tied site (leader or follower) alone."""
    C = spec.site_C
    return Groups.of(spec.sites.names, lambda s: (shapes[s], C[s]),
                     alone=[s for pair in spec.sites.tied for s in pair])


def faithfulness(tied: Mapping[str, str], target, stepped: Components, acc: Components,
                 coeff: float) -> tuple[Array, Components]:
    """Faithfulness, Σ ‖W − V@U‖² / Σ numel(W) over every site (tied followers as their
    leaders' transposes), and `acc` (gradients shaped like `stepped`) + coeff · its
    gradient, added in place (`components.faithfulness_into`)."""
    full = with_tied(stepped, tied)
    # A follower the optimizer does not step (a shared tied update) starts from zero and
    # its gradient lands on its leader (fold_tied).
    zeros = {g: jax.tree.map(jnp.zeros_like, c) for g, c in full.groups.items()
             if g not in acc.groups}
    grads = Components({**acc.groups, **zeros}, full.layout)
    n = sum(c.V.shape[0] * c.V.shape[1] * c.U.shape[2] for c in full.groups.values())
    # A target whose layers are stacked already says where each group's weights are (the
    # Llama); another's are stacked here (`site_weights` is all a new kind needs).
    stacks = (target.weight_stacks(full.layout) if hasattr(target, "weight_stacks")
              else weight_stacks(target.site_weights(), full.layout))
    sq, grads = faithfulness_into(stacks, full, grads, coeff * losses.per(n))
    return sq * losses.per(n), fold_tied(grads, {f: tied[f] for f in zeros})


# How tied sites are updated, by name (`layers.tie_update`): (components, tie map) -> what
# the components' optimizer steps. shared: the owned sites; per_site: every site,
# followers as their leaders' transposes.
TIE_UPDATES: dict[str, Callable[[Components, dict[str, str]], Components]] = {
    "shared": lambda components, tied: components,
    "per_site": with_tied,
}


def optimized_components(spec: StepSpec, components: Components) -> Components:
    return TIE_UPDATES[spec.sites.tie_update](components, dict(spec.sites.tied))


def apply_component_updates(spec: StepSpec, components: Components,
                            updates: Components) -> Components:
    """Optimizer updates (shaped like `optimized_components`) applied to the owned sites."""
    return optax.apply_updates(components, fold_tied(updates, dict(spec.sites.tied)))


def init_state(key: PRNGKeyArray, spec: StepSpec, target,
               optimizers: Optimizers | None = None) -> TrainState:
    """Fresh components and CI function for `target`, and the moments of `optimizers` (the
    spec's when None; pure: usable under eval_shape)."""
    opts = optimizers or Optimizers.of(spec.optim)
    C, tied = spec.site_C, dict(spec.sites.tied)
    shapes = site_shapes(target)
    k_comp, k_ci, k_run = jax.random.split(key, 3)
    layout = site_groups(spec, shapes)
    own = {s: c for s, c in C.items() if s not in tied}  # followers own nothing
    components = Components.init(k_comp, shapes, own, reduce(Groups.without, tied, layout))
    ci_fn = CIFunction.init(k_ci, spec.method.ci, {s: shapes[s][0] for s in C}, C, layout)
    adversary = None
    if spec.method.pgd:
        k_run, k_adv = jax.random.split(k_run)
        keys = jax.random.split(k_adv, len(C))
        sources = {s: jax.random.uniform(k, pgd_source_shape(spec.method.pgd.scope,
                                                             spec.positions,
                                                             c))
                   for k, (s, c) in zip(keys, C.items())}
        adversary = adversary_lib.fresh(layout.stack(sources))
    return TrainState(
        step=jnp.zeros((), jnp.int32), components=components, ci_fn=ci_fn,
        comp_opt=opts.components.init(optimized_components(spec, components)),
        ci_opt=opts.ci_fn.init(ci_fn), adversary=adversary,
        key=k_run)


def faithfulness_warmup(spec: StepSpec, components: Components, target) -> Components:
    """AdamW on faithfulness alone before step 0, so V@U starts near W; the optimizer is
    discarded afterwards."""
    o = spec.optim
    if o.faith_warmup_steps == 0:
        return components
    opt = optax.adamw(o.faith_warmup_lr, weight_decay=o.faith_warmup_weight_decay)

    # The target is an argument, not a closure: a closed-over array becomes a constant in
    # the program (a copy of the target's weights), and one split across processes cannot.
    @jax.jit
    def run(components, target):
        def body(_, carry):
            comps, opt_state = carry
            stepped = optimized_components(spec, comps)
            zero = jax.tree.map(jnp.zeros_like, stepped)
            grads = faithfulness(dict(spec.sites.tied), target, stepped, zero, 1.0)[1]
            updates, opt_state = opt.update(grads, opt_state, stepped)
            return apply_component_updates(spec, comps, updates), opt_state

        init = opt.init(optimized_components(spec, components))
        comps, _ = jax.lax.fori_loop(0, o.faith_warmup_steps, body, (components, init))
        return comps

    return run(components, target)


class Trainable(NamedTuple):
    """What the step's one backward differentiates."""

    components: Components  # as the optimizer steps them (`optimized_components`)
    ci_fn: CIFunction
    sources: dict[str, Array] | None  # the adversary's (None: no PGD term)


class Observed(NamedTuple):
    """What the clean forward of one (micro)batch gives every other part of the step."""

    resid: Array  # the residual entering the first site layer (LMs) or the input (toys)
    inputs: dict[str, Array]  # the site inputs, stacked by group ([n, *pos, d_in])
    streams: Recorded  # LMs: the residual entering each site layer
    recon_target: Array | losses.Logits


@dataclass(frozen=True)
class StepPlan:
    """What a step needs that its spec fixes, made once before tracing: the spec, the two
    optimizers, the output distance, the compute dtype, the recon forwards'
    remat policy, the adversary's learning rate, the tie map, and where the layout pins
    [*pos, C] tensors and the optimizer moments."""

    spec: StepSpec
    comp_opt: optax.GradientTransformation
    ci_opt: optax.GradientTransformation
    distance: Callable[[Array, Array], Array]
    dtype: jnp.dtype
    policy: Callable | None | bool
    lr_pgd: optax.Schedule | None
    tied: dict[str, str]
    pin: Callable[[Array], Array]
    pin_stack: Callable[[Array], Array]  # the same for a group's [n, *pos, C], stacked
    to_device: Callable
    to_host: Callable

    @staticmethod
    def resolve(spec: StepSpec, layout: Layout | None = None,
                optimizers: Optimizers | None = None) -> StepPlan:
        opts = optimizers or Optimizers.of(spec.optim)
        pin = layout.constrain_positions if layout is not None else (lambda x: x)
        pin_stack = layout.constrain_members if layout is not None else (lambda x: x)
        if spec.memory.offload_opt_state:
            if layout is None:
                raise ValueError("memory.offload_opt_state needs the step's layout")
            to_device = partial(move, layout=layout, memory_kind=DEVICE)
            to_host = partial(move, layout=layout, memory_kind=HOST)
        else:
            to_device = to_host = lambda tree: tree
        return StepPlan(
            spec, opts.components, opts.ci_fn,
            losses.distance(spec.method.distance, spec.memory.logits_chunk),
            spec.memory.dtype, spec.memory.recon_policy,
            pgd_lr(spec.method.pgd, spec.total_steps) if spec.method.pgd else None,
            dict(spec.sites.tied), pin,
            pin_stack, to_device, to_host)


def make_train_step(spec: StepSpec, layout: Layout | None = None,
                    optimizers: Optimizers | None = None) -> Callable:
    """The pure train step for `spec`: (state, target, batch) -> (state, metrics). With a
    `layout`, every [*pos, C] tensor is pinned to its batch-on-data, C-on-model sharding.
    `optimizers` (the spec's when None) must be those `init_state` was given."""
    plan = StepPlan.resolve(spec, layout, optimizers)

    def train_step(state: TrainState, target, batch: Array) -> tuple[TrainState, dict]:
        return step(plan, state, target, batch)

    return train_step


def step(plan: StepPlan, state: TrainState, target, batch: Array) -> tuple[TrainState, dict]:
    """One step (the module's docstring numbers its parts)."""
    spec, tied = plan.spec, plan.tied
    key, step_key = jax.random.split(state.key)
    ps = Pass(plan, state, target, batch)

    stepped = optimized_components(spec, state.components)

    # 2'. Imp-min's log term needs S_c over the whole batch: with microbatches, a first
    # pass sums them, and each microbatch's backward then takes dI/dS_c as a constant
    # (exact: I depends on the batch only through the S_c).
    imp_value, imp_grad = importance_over_batch(ps) if ps.n_micro > 1 else (None, None)

    # 3. The adversary's warmup ascents.
    adversary, lr = state.adversary, None
    if spec.method.pgd:
        lr = plan.lr_pgd(state.step)
        adversary = warmup_ascents(ps, lr)

    sources = adversary.sources if adversary is not None else None
    params = Trainable(stepped, state.ci_fn, sources)
    grad_fn = jax.value_and_grad(partial(loss_fn, ps, imp_grad, step_key), has_aux=True)

    def accumulate(acc, obs, m, at):
        (_, aux), g = grad_fn(params, obs, m, at)
        return ps.add(acc, (g, aux))

    method = spec.method
    aux = ({t.name: jnp.zeros((), jnp.float32) for t in method.terms},
           {g: jnp.zeros((len(ss),), jnp.float32) for g, ss in ps.layout.members})
    init = ps.zeros_like((params, aux))
    (g_comp, g_ci, g_src), (terms, l0) = ps.over_microbatches(accumulate, init)
    # Faithfulness reads the weights alone: its value, and its gradient added to the
    # microbatches' in place, once per step (the forwards need no W − V@U; `grouped`).
    faith, g_comp = faithfulness(tied, target, stepped, g_comp, spec.method.faith_coeff)
    # Materialised before the clip and the norm read them: at a batch of one, XLA:CPU fused
    # the whole of a toy's gradient into the norm's scalar reduction, a fusion LLVM did not
    # finish compiling in half an hour.
    g_comp = jax.lax.optimization_barrier(g_comp)
    terms = {"faithfulness": faith,
             "imp_min": terms.pop("imp_min") if imp_grad is None else imp_value, **terms}
    # the random terms' sum, then the others': the order of the sums before the terms tuple
    terms["total"] = (method.faith_coeff * faith + method.imp_coeff * terms["imp_min"]
                      + sum(t.coeff * terms[t.name] for t in method.terms if t.random)
                      + sum(t.coeff * terms[t.name] for t in method.terms if not t.random))
    new = update(plan, state, stepped, (g_comp, g_ci, g_src), adversary, lr, key)
    metrics = {**{f"loss/{k}": v for k, v in terms.items()},
               "train/l0": site_order(ps.layout, spec.sites.names, l0),
               "train/p": ps.p, "train/grad_norm/components": optax.tree.norm(g_comp)}
    return new, metrics


def site_order(layout: Groups, sites: Sequence[str], per_group: Mapping[str, Array]) -> Array:
    """Per-group vectors [n] as one vector in the order of `sites`: a concatenation and one
    gather, whatever the number of sites (`scalars` names its entries on the host)."""
    groups = list(per_group)
    start = dict(zip(groups, [0, *itertools.accumulate(per_group[g].shape[0]
                                                        for g in groups[:-1])]))
    at = [start[g] + k for g, k in (layout.index[s] for s in sites)]
    return jnp.concatenate([per_group[g] for g in groups])[jnp.asarray(at)]


def scalars(metrics: Mapping[str, Array], sites: Sequence[str]) -> dict[str, float]:
    """A step's metrics as floats by name, its L0 vector as `train/l0/<site>` each."""
    out = {k: float(v) for k, v in metrics.items() if k != "train/l0"}
    if "train/l0" in metrics:
        out |= {f"train/l0/{s}": float(v) for s, v in zip(sites, metrics["train/l0"],
                                                           strict=True)}
    return out


def update(plan: StepPlan, state: TrainState, stepped: Components,
           grads: tuple[Components, CIFunction, dict | None], adversary: Adversary | None,
           lr: Array | None, key: Array) -> TrainState:
    """5. Separate optimizers: components clipped and scheduled apart from the CI fn; the
    sources ascend on their own gradient, unscaled by the term's coefficient. Offloaded
    moments come to the device only now, after the backward, and go back to the host. The
    state after the step, with the next step's `key`."""
    spec, (g_comp, g_ci, g_src) = plan.spec, grads
    comp_moments, ci_moments = plan.to_device((state.comp_opt, state.ci_opt))
    upd, comp_state = plan.comp_opt.update(g_comp, comp_moments, stepped)
    components = apply_component_updates(spec, state.components, upd)
    upd, ci_state = plan.ci_opt.update(g_ci, ci_moments, state.ci_fn)
    ci_fn = optax.apply_updates(state.ci_fn, upd)
    comp_state, ci_state = plan.to_host((comp_state, ci_state))
    if spec.method.pgd:
        g_src = jax.tree.map(lambda g: g / spec.method.pgd.coeff, g_src)
        adversary = ascend(adversary, g_src, lr, spec.method.pgd.optimizer)
    return TrainState(step=state.step + 1, components=components, ci_fn=ci_fn,
                      comp_opt=comp_state, ci_opt=ci_state, adversary=adversary, key=key)


class Pass:
    """One step's view of its batch: the clean forward (1), the loop over microbatches that
    every pass over the batch runs, and the forwards the terms measure."""

    def __init__(self, plan: StepPlan, state: TrainState, target, batch: Array):
        self.plan, self.spec, self.state, self.batch = plan, plan.spec, state, batch
        self.n_micro = plan.spec.microbatches
        self.prefix, self.suffix = target.split(self.spec.sites.names, self.spec.memory)
        # every site's group, followers of tied sites included (`with_tied`)
        self.layout = with_tied(state.components, plan.tied).layout
        self.every = self.layout.live(self.spec.sites.names)
        self.p = losses.p_at(state.step, self.spec.total_steps, *self.spec.method.p)
        # With one microbatch the clean forward runs once and every pass reads it.
        self.whole = self.observe(batch) if self.n_micro == 1 else None
        some = self.whole if self.whole is not None else jax.eval_shape(
            lambda: self.observe(self.microbatch(batch, 0)))
        self.pos = next(iter(some.inputs.values())).shape[1:-1]  # a microbatch's positions
        self.n_pos = math.prod(self.pos) * self.n_micro
        # A recon forward samples its masks inside the rematerialized function, so the
        # backward redraws them from their key instead of keeping them for every forward.
        if plan.policy is not False:  # rematerialize: the backward reruns each forward
            self.recon_distance = jax.checkpoint(self.recon_distance, policy=plan.policy,
                                                 static_argnums=(0, 1, 2))
            self.pgd_distance = jax.checkpoint(self.pgd_distance, policy=plan.policy)

    def observe(self, batch: Array) -> Observed:
        """Outside every gradient graph: the residual start, then the clean forward, which
        gives the recon target and the CI function's inputs."""
        resid = jax.lax.stop_gradient(self.prefix(batch))
        recorded, streams = Recorded(), Recorded()
        clean = self.suffix(resid, recording_linear(recorded, self.spec.sites.names),
                            streams=streams)
        # each group's inputs whole, as a scan over its layers recorded them
        inputs = {g: recorded.stack(self.layout.of_group(g)) for g in self.every}
        return jax.lax.stop_gradient(Observed(
            resid, inputs, streams,
            losses.recon_target(self.spec.method.distance, clean,
                                self.spec.memory.logits_chunk)))

    def microbatch(self, x: Array, m: Array | int, axis: int = 0) -> Array:
        """Microbatch m holds examples m, m + n, m + 2n, ...: every device keeps its rows
        (of `axis`, the examples' axis)."""
        x = jnp.moveaxis(x, axis, 0)
        x = x.reshape(x.shape[0] // self.n_micro, self.n_micro, *x.shape[1:])[:, m]
        return jnp.moveaxis(x, 0, axis)

    def over_microbatches(self, body: Callable, carry, prepare: Callable = lambda o: o,
                          prepared=None):
        """carry = body(carry, prepare(observed), m, positions) for every microbatch;
        `prepared`: prepare(whole) already computed (one microbatch). Each pass runs one
        compiled body per microbatch, re-running the clean forward rather than keeping n."""
        if self.n_micro == 1:
            return body(carry, prepare(self.whole) if prepared is None else prepared, 0, None)
        pos, n = self.pos, self.n_micro

        def scan_body(carry, m):
            at = Positions.microbatch((pos[0] * n, *pos[1:]), n, m)
            return body(carry, prepare(self.observe(self.microbatch(self.batch, m))), m,
                        at), None

        return jax.lax.scan(scan_body, carry, jnp.arange(n))[0]

    def source_rows(self, src: Array, m) -> Array:
        """A group's per-example sources' rows for microbatch m; shared ones as they are."""
        return src if self.n_micro == 1 or src.shape[1] == 1 else self.microbatch(src, m, 1)

    def group_lower(self, ci, live, components) -> dict[str, Array]:
        """ci_lower of the live members of each group (`live`: group -> members), stacked:
        read from `ci` (every member's, by group), or, when the step streams its CI,
        recomputed from `ci` = (CI function, its features)."""
        if isinstance(ci, dict):
            return {g: take(ci[g], ix, len(self.layout.of_group(g))) for g, ix in live.items()}
        ci_fn, features = ci
        return {g: ci_lower(self.plan.pin_stack(v))
                for g, v in ci_fn.logits_of(features, live, components).items()}

    def recon_distance(self, live, source, routing, components, ci, key, obs, at):
        at_groups = self.layout.live(live)
        lower = self.group_lower(ci, at_groups, components)
        parts = group_parts(key, live, self.layout, source, routing, lower, at)
        delta = self.spec.method.delta
        out = self.suffix(obs.resid, from_parts(components, parts, at_groups, delta),
                          streams=obs.streams, live=live)
        return self.plan.distance(out, obs.recon_target)

    def pgd_distance(self, components, ci, sources, obs):
        lower = self.group_lower(ci, self.every, components)
        parts = {g: MaskParts(lower[g], src, None) for g, src in sources.items()}
        delta = self.spec.method.delta
        out = self.suffix(obs.resid, from_parts(components, parts, self.every, delta),
                          streams=obs.streams, live=self.spec.sites.names)
        return self.plan.distance(out, obs.recon_target)

    def l0_of(self, lower: Array, lead: int = 0) -> Array:
        """The mean number of components over the threshold per position (per member of a
        stack: `lead` leading member axes)."""
        active = jnp.sum(lower > self.spec.method.ci_threshold, axis=-1).astype(jnp.float32)
        return jnp.mean(active, axis=tuple(range(lead, active.ndim)))

    def site_sums(self, ci_fn, features, components) -> tuple[dict, dict]:
        """Each group's imp-min sums S_c [n, C] and L0s [n], one site's logits at a time,
        gone once they are taken (streamed: rematerialized, the backward recomputes them)."""
        def sums(logits):
            logits = self.plan.pin(logits)
            S = losses.importance_sums({"": ci_upper(logits)}, self.p, self.spec.method.eps,
                                       penalty=self.spec.method.penalty)[""]
            return S, jax.lax.stop_gradient(self.l0_of(ci_lower(logits)))

        out = ci_fn.per_group(features, self.every, components, sums)
        return {g: v[0] for g, v in out.items()}, {g: v[1] for g, v in out.items()}

    def add(self, acc, x):  # a running sum over microbatches (None: the first)
        return x if acc is None else jax.tree.map(jnp.add, acc, x)

    def zeros_like(self, tree):
        return None if self.n_micro == 1 else jax.tree.map(jnp.zeros_like, tree)


def importance_over_batch(ps: Pass) -> tuple[Array, dict[str, Array]]:
    """Imp-min's value over the whole batch and its gradient in each site's sums S_c: a
    first pass over the microbatches sums them (components and CI function detached)."""
    spec, state = ps.spec, ps.state
    comps = jax.lax.stop_gradient(with_tied(state.components, ps.plan.tied))

    def sums(acc, obs, m, at):
        features = state.ci_fn.features(obs.inputs, comps)
        if spec.memory.stream_ci:  # one site's logits at a time
            S = ps.site_sums(state.ci_fn, features, comps)[0]
        else:
            upper = {g: ci_upper(v)
                     for g, v in state.ci_fn.logits_of(features, ps.every, comps).items()}
            S = losses.importance_sums(upper, ps.p, spec.method.eps, members=True,
                                       penalty=spec.method.penalty)
        return jax.tree.map(jnp.add, acc, S)

    C = spec.site_C
    S = ps.over_microbatches(sums, {g: jnp.zeros((len(ss), C[ss[0]]), jnp.float32)
                                    for g, ss in ps.layout.members})
    return jax.value_and_grad(losses.importance_from_sums)(S, ps.n_pos, spec.method.beta)


def warmup_ascents(ps: Pass, lr: Array) -> Adversary:
    """The adversary after its warmup ascents, against detached components and CI (a loop,
    not unrolled: one compiled ascent however many there are), each on the gradient of the
    whole batch."""
    spec, state, n_micro = ps.spec, ps.state, ps.n_micro
    comps = jax.lax.stop_gradient(with_tied(state.components, ps.plan.tied))

    def detached(obs):
        features = state.ci_fn.features(obs.inputs, comps)
        if spec.memory.stream_ci:
            return obs, (state.ci_fn, jax.lax.stop_gradient(features))
        return obs, jax.lax.stop_gradient(
            {g: ci_lower(v) for g, v in state.ci_fn.logits_of(features, ps.every, comps).items()})

    prepared = detached(ps.whole) if n_micro == 1 else None

    def warmup_ascent(_, adv):
        def grad_of(acc, inputs, m, at):
            obs, ci = inputs
            g = jax.grad(lambda src: ps.pgd_distance(
                comps, ci,
                {s: ps.source_rows(v, m) for s, v in src.items()}, obs))(adv.sources)
            return ps.add(acc, jax.tree.map(lambda x: x / n_micro, g))

        g = ps.over_microbatches(grad_of, ps.zeros_like(adv.sources), detached, prepared)
        return ascend(adv, g, lr, spec.method.pgd.optimizer)

    return jax.lax.fori_loop(0, spec.method.pgd.n_warmup, warmup_ascent, state.adversary)


def loss_fn(ps: Pass, imp_grad: dict[str, Array] | None, step_key: Array, params: Trainable,
            obs, m, at) -> tuple[Array, tuple[dict[str, Array], dict[str, Array]]]:
    """One microbatch's share of the loss (2, 4), differentiated in `params`; its terms and
    L0s."""
    spec, n_micro = ps.spec, ps.n_micro
    stepped_components, ci_fn, sources = params
    # Shared tied update: the followers are built here, so both sites' gradients sum on the
    # owned parameters. Per-site: they came in with the stepped components
    # (optimized_components), with gradients of their own.
    components = with_tied(stepped_components, ps.plan.tied)
    # 2. Causal importances, and imp-min's sums and the L0s from them.
    features = ci_fn.features(obs.inputs, components, spec.memory.remat_layers)
    if spec.memory.stream_ci:
        ci = (ci_fn, features)
        S, l0 = ps.site_sums(ci_fn, features, components)
    else:
        logits = {g: ps.plan.pin_stack(v)
                  for g, v in ci_fn.logits_of(features, ps.every, components).items()}
        ci = {g: ci_lower(v) for g, v in logits.items()}
        S = losses.importance_sums({g: ci_upper(v) for g, v in logits.items()}, ps.p,
                                   spec.method.eps, members=True, penalty=spec.method.penalty)
        l0 = {g: ps.l0_of(v, lead=1) for g, v in ci.items()}
    # 4. Losses: this microbatch's share of the batch means.
    if imp_grad is None:
        imp = losses.importance_from_sums(S, ps.n_pos, spec.method.beta)
        terms = {"imp_min": imp}
    else:
        imp = sum(jnp.sum(imp_grad[g] * S[g]) for g in S)
        terms = {}
    total = spec.method.imp_coeff * imp
    mb = Microbatch(ps, components, ci, sources, obs, m, at)
    random = [t for t in spec.method.terms if t.random]
    keys = dict(zip(random, jax.random.split(step_key, max(len(random), 1))))
    for term in spec.method.terms:
        terms[term.name] = term.value(mb, keys.get(term)) / n_micro
        total = total + term.coeff * terms[term.name]
    return total, (terms, {s: v / n_micro for s, v in l0.items()})

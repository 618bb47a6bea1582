"""The cross-field checks of a run config, done before anything is made: each config group's
values against each other and against the registries beside their implementations (the
CI functions, plans, sources, routings, distances, schedules, remat policies, GPUs, model
kinds), so an error lists the names that are allowed. Raises ConfigError on the first
problem."""

from __future__ import annotations

from collections.abc import Iterable

from pdecomp.core.config import (
    DATA_SOURCES,
    DTYPES,
    FIT_MODES,
    LOGICAL_AXES,
    MESH_AXES,
    REMAT_NAMES,
    SEED_MAX,
    TOKEN_DTYPES,
    WANDB_MODES,
    ConfigError,
    OptGroupConfig,
    RunConfig,
    check_positive,
)
from pdecomp.core.hardware import GPUS
from pdecomp.core.memory import REMAT, SITE_LAYER_SAVES
from pdecomp.core.sharding import mesh_candidates, planned_gpus
from pdecomp.kinds import KINDS, kind_of, site_names_of, tied_sites
from pdecomp.plan.resolve import data_axis
from pdecomp.spd.adversary import PGD_OPTIMIZERS
from pdecomp.spd.ci import CI_FNS
from pdecomp.spd.losses import DISTANCES, PENALTIES
from pdecomp.spd.masks import PGD_SCOPES, PLANS, ROUTINGS, SOURCES
from pdecomp.spd.step import SCHEDULES, TIE_UPDATES


def _choice(key: str, value: str, allowed: Iterable[str]) -> None:
    """`value` one of `allowed` (a registry's names), else a ConfigError that lists them."""
    if value not in allowed:
        raise ConfigError(key, value, f"allowed: {', '.join(allowed)}")


def _fraction(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(key, value, "must be a fraction in [0, 1]")


def validate(cfg: RunConfig, n_devices: int | None = None, scan_data: bool = True) -> None:
    """Cross-field checks that types cannot express. Raises ConfigError on the first problem.

    `n_devices`: the devices the job has, where known (in the job, not for a deviceless
    gate, whose mesh is the planned hosts x GPUs). Without `scan_data`, a token source's
    headers and sizes are checked, not its every id (a submission: the job scans them)."""
    for check in (_validate_model, _validate_layers, _validate_loss, _validate_optim):
        check(cfg)
    _validate_data(cfg, scan_data)
    _validate_microbatch_size(cfg, n_devices)
    _validate_mesh(cfg, n_devices)
    _validate_memory_and_gate(cfg)


def _validate_model(cfg: RunConfig) -> None:
    """The target: seeds, then its kind's own checks (sizes, a Llama's architecture or
    checkpoint)."""

    m = cfg.model
    for key, seed in (("seed", cfg.seed), ("model.seed", m.seed)):
        if not 0 <= seed <= SEED_MAX:
            raise ConfigError(key, seed, f"must be an integer in [0, {SEED_MAX}] (for every "
                              "model kind)")
    _choice("model.kind", m.kind, KINDS)
    kind_of(m).validate(m)


def _validate_layers(cfg: RunConfig) -> None:
    """The sites, their C and ties, and the CI function."""
    m = cfg.model
    known = site_names_of(m)
    lay = cfg.layers
    if not lay.sites:
        raise ConfigError("layers.sites", lay.sites, f"choose one or more of: {', '.join(known)}")
    for s in lay.sites:
        if s not in known:
            raise ConfigError("layers.sites", s, f"sites of model {m.name}: {', '.join(known)}")
    if len(set(lay.sites)) != len(lay.sites):
        raise ConfigError("layers.sites", lay.sites, "each site may appear once")
    check_positive("layers.C", lay.C)
    check_positive("layers.C_per_dim", lay.C_per_dim, zero_ok=True)
    for s, c in lay.C_per_site.items():
        if s not in lay.sites:
            raise ConfigError(f"layers.C_per_site.{s}", c, f"keys must be decomposed sites: "
                              f"{', '.join(lay.sites)}")
        check_positive(f"layers.C_per_site.{s}", c)
    for follower, leader in tied_sites(cfg.model, cfg.layers).items():
        c_f, c_l = lay.C_per_site.get(follower, lay.C), lay.C_per_site.get(leader, lay.C)
        if c_f != c_l:
            raise ConfigError(f"layers.C_per_site.{follower}", c_f,
                              f"tied to {leader}: needs its C ({c_l}), or set layers.tie=false")

    _choice("layers.tie_update", lay.tie_update, TIE_UPDATES)
    _choice("layers.ci_fn", lay.ci_fn, CI_FNS)
    for h in lay.ci_hidden:
        check_positive("layers.ci_hidden", h)
    if lay.ci_fn == "global_transformer":
        for key in ("ci_d_model", "ci_blocks", "ci_heads", "ci_mlp"):
            check_positive(f"layers.{key}", getattr(lay, key))
        if lay.ci_d_model % lay.ci_heads or (lay.ci_d_model // lay.ci_heads) % 2:
            raise ConfigError("layers.ci_heads", lay.ci_heads,
                              f"layers.ci_d_model ({lay.ci_d_model}) / heads must be an even "
                              "integer (RoPE rotates pairs)")


def _validate_loss(cfg: RunConfig) -> None:
    """The loss terms, their schedules and the recon plans."""
    m, lay = cfg.model, cfg.layers
    lo = cfg.loss
    for key in ("faithfulness_coeff", "imp_min_coeff", "beta", "eps"):
        check_positive(f"loss.{key}", getattr(lo, key), zero_ok=True)
    check_positive("loss.p_start", lo.p_start)
    check_positive("loss.p_end", lo.p_end)
    _choice("loss.imp_min_penalty", lo.imp_min_penalty, PENALTIES)
    check_positive("loss.gamma_start", lo.gamma_start)
    check_positive("loss.gamma_end", lo.gamma_end)
    _fraction("loss.p_anneal_start_frac", lo.p_anneal_start_frac)
    _fraction("loss.p_anneal_end_frac", lo.p_anneal_end_frac)
    if lo.p_anneal_end_frac < lo.p_anneal_start_frac:
        raise ConfigError("loss.p_anneal_end_frac", lo.p_anneal_end_frac,
                          f"must be >= loss.p_anneal_start_frac ({lo.p_anneal_start_frac})")
    _fraction("loss.ci_threshold", lo.ci_threshold)

    _choice("loss.distance", lo.distance, DISTANCES)
    if not lo.recon:
        raise ConfigError("loss.recon", {}, "give at least one recon term")
    for name, t in lo.recon.items():
        k = f"loss.recon.{name}"
        check_positive(f"{k}.coeff", t.coeff, zero_ok=True)
        _choice(f"{k}.plan", t.plan, PLANS)
        _choice(f"{k}.source", t.source, SOURCES)
        _choice(f"{k}.routing", t.routing, ROUTINGS)
        if t.plan == "chunkwise" and not 1 <= t.sites_per_chunk <= len(lay.sites):
            raise ConfigError(f"{k}.sites_per_chunk", t.sites_per_chunk,
                              f"must be in 1..{len(lay.sites)} (the number of sites)")
    pgd = lo.pgd
    check_positive("loss.pgd.coeff", pgd.coeff, zero_ok=True)
    _choice("loss.pgd.scope", pgd.scope, PGD_SCOPES)
    _choice("loss.eval_pgd.scope", lo.eval_pgd.scope, PGD_SCOPES)
    _choice("loss.pgd.optimizer", pgd.optimizer, PGD_OPTIMIZERS)
    check_positive("loss.pgd.lr", pgd.lr)
    _fraction("loss.pgd.warmup_frac", pgd.warmup_frac)
    check_positive("loss.pgd.n_warmup", pgd.n_warmup, zero_ok=True)
    check_positive("loss.eval_pgd.n_steps", lo.eval_pgd.n_steps, zero_ok=True)
    check_positive("loss.eval_pgd.step_size", lo.eval_pgd.step_size)
    check_positive("loss.eval_pgd.curve_to", lo.eval_pgd.curve_to, zero_ok=True)
    if 0 < lo.eval_pgd.curve_to < lo.eval_pgd.n_steps:
        raise ConfigError("loss.eval_pgd.curve_to", lo.eval_pgd.curve_to,
                          f"must be at least loss.eval_pgd.n_steps ({lo.eval_pgd.n_steps}, "
                          "the curve's first point), or 0 for no curve")
    kind = kind_of(m)
    if lo.distance != kind.distance:
        raise ConfigError("loss.distance", lo.distance, f"model {m.name} ({m.kind}) is "
                          f"compared by {kind.distance}: {kind.distance_why}")


def _validate_optim(cfg: RunConfig) -> None:
    """The optimizers and the microbatches."""

    o = cfg.optim
    check_positive("optim.steps", o.steps)
    check_positive("optim.faith_warmup_steps", o.faith_warmup_steps, zero_ok=True)
    check_positive("optim.microbatches", o.microbatches)
    if cfg.data.batch_size % o.microbatches:
        raise ConfigError("optim.microbatches", o.microbatches,
                          f"must divide data.batch_size ({cfg.data.batch_size})")
    check_positive("optim.faith_warmup_lr", o.faith_warmup_lr)
    for group in ("components", "ci_fn"):
        g: OptGroupConfig = getattr(o, group)
        check_positive(f"optim.{group}.lr", g.lr)
        _choice(f"optim.{group}.schedule", g.schedule, SCHEDULES)
        _fraction(f"optim.{group}.warmup_frac", g.warmup_frac)
        _fraction(f"optim.{group}.final_frac", g.final_frac)
        _fraction(f"optim.{group}.b1", g.b1)
        _fraction(f"optim.{group}.b2", g.b2)
        check_positive(f"optim.{group}.weight_decay", g.weight_decay, zero_ok=True)
        check_positive(f"optim.{group}.clip_norm", g.clip_norm, zero_ok=True)


def _validate_data(cfg: RunConfig, scan: bool = True) -> None:
    """The data source and what the target reads."""
    m = cfg.model
    d = cfg.data
    check_positive("data.batch_size", d.batch_size)
    check_positive("data.eval_batches", d.eval_batches, zero_ok=True)
    _choice("data.source", d.source, DATA_SOURCES)
    kind = kind_of(m)
    if d.source not in kind.data_sources:
        raise ConfigError("data.source", d.source,
                          f"model {m.name} ({m.kind}) reads: {', '.join(kind.data_sources)}")
    _choice("data.token_dtype", d.token_dtype, TOKEN_DTYPES)
    check_positive("data.seq_len", d.seq_len)
    if not 0.0 <= d.eval_frac < 1.0:
        raise ConfigError("data.eval_frac", d.eval_frac, "must be in [0, 1)")
    if d.source in ("tokens", "hf_dataset") and not d.path and not cfg.gate.only:
        raise ConfigError("data.path", d.path, f"data.source={d.source} needs a path")
    if not cfg.gate.only:  # a gate reads shapes, not the data
        kind.validate_data(m, d, cfg.seed, scan)


def _validate_mesh_fit(cfg: RunConfig) -> None:
    """gate.fit=mesh ranks splits by the step time at a GPU's published rates, over the
    GPUs the mesh plans (mesh.hosts x mesh.gpus_per_host); it chooses mesh.data itself."""
    g, me = cfg.gate, cfg.mesh
    if g.target not in GPUS:
        raise ConfigError("gate.fit", g.fit, "ranks meshes by the step time predicted at a "
                          f"GPU's published rates: needs gate.target={'|'.join(GPUS)}")
    if me.data:
        raise ConfigError("mesh.data", me.data, "gate.fit=mesh chooses the data axis: "
                          "leave mesh.data=0")
    microbatch = cfg.data.batch_size // cfg.optim.microbatches
    if not mesh_candidates(me, microbatch):
        raise ConfigError("data.batch_size", cfg.data.batch_size,
                          f"gate.fit=mesh: no split of {me.hosts} x "
                          f"{planned_gpus(me)[0]} GPUs leaves a data axis that divides "
                          f"a microbatch of {microbatch} examples")


def _validate_microbatch_size(cfg: RunConfig, n_devices: int | None) -> None:
    """optim.microbatch_size: one of it and optim.microbatches, a batch it divides on the
    mesh's data axis, and no gate search that would change what it fixes."""
    o, fit = cfg.optim, cfg.gate.fit
    check_positive("optim.microbatch_size", o.microbatch_size, zero_ok=True)
    if not o.microbatch_size:
        return
    if fit != "none":
        raise ConfigError("optim.microbatch_size", o.microbatch_size,
                          f"fixes the microbatches that gate.fit={fit} would search: set "
                          "optim.microbatch_size=0 or gate.fit=none")
    axis = data_axis(cfg, n_devices)
    if axis is not None and cfg.data.batch_size % (o.microbatch_size * axis):
        raise ConfigError("optim.microbatch_size", o.microbatch_size,
                          f"x the mesh's data axis ({axis}) must divide data.batch_size "
                          f"({cfg.data.batch_size})")
    resolved = None if axis is None else cfg.data.batch_size // (o.microbatch_size * axis)
    if o.microbatches not in (1, resolved):
        raise ConfigError("optim.microbatches", o.microbatches,
                          f"set one of optim.microbatches and optim.microbatch_size "
                          f"({o.microbatch_size})")


def _validate_mesh(cfg: RunConfig, n_devices: int | None) -> None:
    """The mesh, against the planned devices and the job's own."""

    _choice("gate.target", cfg.gate.target, ("local", *GPUS))
    me = cfg.mesh
    check_positive("mesh.data", me.data, zero_ok=True)
    check_positive("mesh.hosts", me.hosts)
    check_positive("mesh.gpus_per_host", me.gpus_per_host, zero_ok=True)
    check_positive("mesh.init_timeout_s", me.init_timeout_s)
    check_positive("mesh.model", me.model)
    for name, axis in me.rules.items():
        _choice("mesh.rules", name, LOGICAL_AXES)
        _choice(f"mesh.rules.{name}", axis, MESH_AXES)
    planned = planned_gpus(me)[1]  # the devices a run is sized for
    if (cfg.gate.target != "local" or me.gpus_per_host) and planned % me.model:
        raise ConfigError("mesh.model", me.model, f"must divide the mesh's {planned} devices")
    data_axis = planned // me.model
    micro = cfg.data.batch_size // max(cfg.optim.microbatches, 1)  # a microbatch's examples
    per_micro = (f" in each of optim.microbatches={cfg.optim.microbatches} microbatches"
                 if cfg.optim.microbatches > 1 else "")
    if me.data and cfg.gate.target != "local" and me.data != data_axis:
        raise ConfigError("mesh.data", me.data, f"must be 0 or mesh.hosts x mesh.gpus_per_host "
                          f"/ mesh.model ({data_axis}) for gate.target={cfg.gate.target}")
    if n_devices is not None and me.gpus_per_host and planned > n_devices:
        raise ConfigError("mesh.gpus_per_host", me.gpus_per_host,
                          f"mesh.hosts x mesh.gpus_per_host = {planned} devices; the job has "
                          f"{n_devices}")
    if n_devices is not None and not me.gpus_per_host and n_devices % me.model:
        raise ConfigError("mesh.model", me.model, f"must divide the job's {n_devices} devices")
    if n_devices is not None and me.data:
        if me.data * me.model > n_devices:
            raise ConfigError("mesh.data", me.data, f"mesh.data x mesh.model = "
                              f"{me.data * me.model} devices; the job has {n_devices}")
        if micro % me.data:
            raise ConfigError("data.batch_size", cfg.data.batch_size,
                              f"must be divisible by the data axis size {me.data}{per_micro}")
    if cfg.gate.target != "local" and micro % data_axis:
        where = (f"{planned} {cfg.gate.target} GPUs of the mesh" if me.model == 1 else
                 f"{data_axis} devices of the mesh's data axis")
        raise ConfigError("data.batch_size", cfg.data.batch_size,
                          f"must be divisible by the {where}{per_micro}")


def _validate_memory_and_gate(cfg: RunConfig) -> None:
    """The memory plan and the gate."""
    mem = cfg.memory
    check_positive("memory.hbm_cap_gib", mem.hbm_cap_gib, zero_ok=True)
    if not 0.0 < mem.safety_fraction <= 1.0:
        raise ConfigError("memory.safety_fraction", mem.safety_fraction, "must be in (0, 1]")
    _choice("memory.compute_dtype", mem.compute_dtype, DTYPES)
    _choice("memory.target_dtype", mem.target_dtype, DTYPES)
    if mem.matmul_dtype is not None:
        _choice("memory.matmul_dtype", mem.matmul_dtype, DTYPES)

    _choice("memory.remat", mem.remat, REMAT)
    _choice("memory.site_layer_saves", mem.site_layer_saves, SITE_LAYER_SAVES)
    for name in mem.remat_names:
        _choice("memory.remat_names", name, REMAT_NAMES)
    check_positive("memory.logits_chunk", mem.logits_chunk, zero_ok=True)
    if cfg.loss.distance == "kl" and mem.logits_chunk and cfg.data.seq_len % mem.logits_chunk:
        raise ConfigError("memory.logits_chunk", mem.logits_chunk,
                          f"must divide data.seq_len={cfg.data.seq_len} (0: whole)")
    g = cfg.gate
    _choice("gate.fit", g.fit, FIT_MODES)
    if g.fit == "mesh":
        _validate_mesh_fit(cfg)
    check_positive("gate.fit_max_batch", g.fit_max_batch)
    check_positive("gate.top_temps", g.top_temps, zero_ok=True)
    check_positive("gate.calibrate_after", g.calibrate_after)
    check_positive("logging.log_every", cfg.logging.log_every)
    check_positive("logging.ckpt_every", cfg.logging.ckpt_every, zero_ok=True)
    check_positive("logging.eval_every", cfg.logging.eval_every, zero_ok=True)
    check_positive("logging.slow_eval_every", cfg.logging.slow_eval_every, zero_ok=True)
    if (cfg.logging.eval_every or cfg.logging.slow_eval_every) and not cfg.data.eval_batches:
        raise ConfigError("data.eval_batches", 0, "evaluation in the loop "
                          "(logging.eval_every, slow_eval_every) needs held-out batches: "
                          "give data.eval_batches >= 1")
    check_positive("logging.stop_check_every", cfg.logging.stop_check_every)
    if cfg.logging.wandb.mode:
        _choice("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)

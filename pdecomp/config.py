"""The run schema: frozen dataclasses, one per config group, and the cross-field checks.

The launcher registers these classes in Hydra's ConfigStore (the "config registry"), so a
typo or a wrong type fails at compose time; `validate` then checks what types cannot.
Every error names the dotted key, the value and what is allowed.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

# Values allowed for the string-valued choices; `validate` quotes them in its errors.
TARGETS = ("tms", "resid_mlp")
CI_FN_TYPES = ("mlp", "vector_mlp", "shared_mlp")
SOURCES = ("continuous", "binomial", "ci")
ROUTINGS = ("all", "uniform_k")
PLANS = ("all", "layerwise", "chunkwise")
DISTANCES = ("mse", "kl")
SCHEDULES = ("constant", "linear", "cosine")
GATE_TARGETS = ("local", "h100", "h200", "b200")  # pdecomp.hardware.GPUS
FIT_MODES = ("none", "batch")
DTYPES = ("float32", "bfloat16")


EXIT_BAD_CONFIG = 2  # the exit code of a run refused for its config


class ConfigError(ValueError):
    """A bad value in the run config. `str()` is the one-line message shown to the user."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config error: {key}={value!r} is not allowed; {allowed}")


@dataclass(frozen=True)
class ModelConfig:
    """The frozen target. Toy targets are trained in-process and cached by their settings."""

    name: str = "tms_5-2"
    kind: str = "tms"  # one of TARGETS
    n_features: int = 5
    d_hidden: int = 2  # TMS hidden size m; residual MLP neurons per layer
    d_embed: int = 1000  # residual MLP stream width
    n_layers: int = 1  # residual MLP layers
    n_hidden_layers: int = 0  # TMS +ID variants: fixed identity layers between linear1/linear2
    feature_prob: float = 0.05
    train_steps: int = 10_000
    train_batch_size: int = 1024
    train_lr: float = 5e-3
    seed: int = 0
    max_retrain: int = 3  # retries with a new seed when the target misses a feature
    cache_dir: str = ""  # empty: $PDECOMP_CACHE or ~/.cache/pdecomp


@dataclass(frozen=True)
class LayersConfig:
    """Which sites to decompose and with how many components each."""

    sites: list[str] = field(default_factory=lambda: ["linear1", "linear2"])
    C: int = 20
    C_per_site: dict[str, int] = field(default_factory=dict)  # overrides C for named sites
    delta: bool = True
    ci_fn: str = "mlp"  # one of CI_FN_TYPES
    ci_hidden: list[int] = field(default_factory=lambda: [16])
    # A target with tied weights (TMS: linear2 = linear1ᵀ) gets tied components too: the
    # follower's V, U are its leader's Uᵀ, Vᵀ and own no parameters (as in the SPD paper).
    tie: bool = True


@dataclass(frozen=True)
class ReconTermConfig:
    """One stochastic reconstruction term: a plan of forwards, a source and a routing."""

    coeff: float = 1.0
    plan: str = "all"  # one of PLANS
    sites_per_chunk: int = 0  # chunkwise only
    source: str = "continuous"  # one of SOURCES
    routing: str = "all"  # one of ROUTINGS


@dataclass(frozen=True)
class LossConfig:
    faithfulness_coeff: float = 0.0
    imp_min_coeff: float = 3e-3
    p_start: float = 1.0
    p_end: float = 1.0
    p_anneal_start_frac: float = 0.0
    p_anneal_end_frac: float = 1.0
    beta: float = 0.0
    eps: float = 1e-12
    ci_threshold: float = 0.1
    distance: str = "mse"  # one of DISTANCES
    recon: dict[str, ReconTermConfig] = field(
        default_factory=lambda: {
            "full": ReconTermConfig(plan="all"),
            "layerwise": ReconTermConfig(plan="layerwise"),
        }
    )


@dataclass(frozen=True)
class OptGroupConfig:
    """AdamW over one parameter group, with its own schedule and clipping."""

    lr: float = 1e-3
    schedule: str = "cosine"  # one of SCHEDULES
    warmup_frac: float = 0.0
    final_frac: float = 0.0  # lr at the end, as a fraction of lr
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 0.0  # global-norm clip; 0 disables


@dataclass(frozen=True)
class OptimConfig:
    steps: int = 10_000
    components: OptGroupConfig = field(default_factory=OptGroupConfig)
    ci_fn: OptGroupConfig = field(default_factory=OptGroupConfig)
    faith_warmup_steps: int = 200
    faith_warmup_lr: float = 0.01
    faith_warmup_weight_decay: float = 0.1


@dataclass(frozen=True)
class DataConfig:
    batch_size: int = 4096
    eval_batches: int = 8  # batches used for the final metrics (live components, MMCS)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: one data axis. The batch is split over it; with `shard_state` (FSDP) the
    frozen target, components, CI function and optimizer moments are split over it too."""

    name: str = "local"
    data: int = 0  # devices on the data axis; 0: every device (local) or hosts x gpus_per_host
    hosts: int = 1  # the GPUs a run is sized for: a deviceless gate compiles for
    gpus_per_host: int = 0  # hosts x gpus_per_host of them (0: one GPU)
    shard_state: bool = False


@dataclass(frozen=True)
class MemoryConfig:
    hbm_cap_gib: float = 0.0  # 0: the device's own limit times safety_fraction
    safety_fraction: float = 0.9
    donate: bool = True
    compute_dtype: str = "float32"  # one of DTYPES


@dataclass(frozen=True)
class GateConfig:
    only: bool = False  # report and exit
    target: str = "local"  # one of GATE_TARGETS: this job's devices, or a GPU to compile for
    fit: str = "none"  # one of FIT_MODES: "batch" finds the largest batch under the cap
    fit_max_batch: int = 1 << 20  # upper end of the batch search
    top_temps: int = 8  # largest temporaries listed from XLA's buffer assignment; 0: none
    calibrate_after: int = 10  # steps before the measured peak is read (where reported)


@dataclass(frozen=True)
class LoggingConfig:
    log_every: int = 100
    ckpt_every: int = 2000  # 0: only at the end
    wandb: bool = True
    wandb_project: str = "pdecomp"
    progress: bool = True
    plots: bool = True


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    layers: LayersConfig = field(default_factory=LayersConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 0
    name: str = "run"


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, f"allowed: {', '.join(allowed)}")


def _positive(key: str, value: float, *, zero_ok: bool = False) -> None:
    bad = value < 0 if zero_ok else value <= 0
    if bad or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(key, value, "must be >= 0" if zero_ok else "must be > 0")


def _fraction(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(key, value, "must be a fraction in [0, 1]")


def site_names_of(model: ModelConfig) -> tuple[str, ...]:
    """The target's sites in their fixed, documented order."""
    if model.kind == "tms":
        hidden = tuple("hidden" if model.n_hidden_layers == 1 else f"hidden.{i}"
                       for i in range(model.n_hidden_layers))
        return ("linear1", *hidden, "linear2")
    if model.kind == "resid_mlp":
        return tuple(f"layers.{i}.{w}" for i in range(model.n_layers) for w in ("mlp_in", "mlp_out"))
    raise ConfigError("model.kind", model.kind, f"allowed: {', '.join(TARGETS)}")


def validate(cfg: RunConfig, n_devices: int | None = None) -> None:
    """Cross-field checks that types cannot express. Raises ConfigError on the first problem.

    `n_devices`: the devices the job has, where known (in the job, not for a deviceless
    gate, whose mesh is the planned hosts x GPUs)."""
    m = cfg.model
    _choice("model.kind", m.kind, TARGETS)
    for key in ("n_features", "d_hidden", "d_embed", "n_layers", "train_steps", "train_batch_size"):
        _positive(f"model.{key}", getattr(m, key))
    _positive("model.n_hidden_layers", m.n_hidden_layers, zero_ok=True)
    if not 0.0 < m.feature_prob <= 1.0:
        raise ConfigError("model.feature_prob", m.feature_prob, "must be in (0, 1]")
    _positive("model.train_lr", m.train_lr)

    known = site_names_of(m)
    lay = cfg.layers
    if not lay.sites:
        raise ConfigError("layers.sites", lay.sites, f"choose one or more of: {', '.join(known)}")
    for s in lay.sites:
        if s not in known:
            raise ConfigError("layers.sites", s, f"sites of model {m.name}: {', '.join(known)}")
    if len(set(lay.sites)) != len(lay.sites):
        raise ConfigError("layers.sites", lay.sites, "each site may appear once")
    _positive("layers.C", lay.C)
    for s, c in lay.C_per_site.items():
        if s not in lay.sites:
            raise ConfigError(f"layers.C_per_site.{s}", c, f"keys must be decomposed sites: "
                              f"{', '.join(lay.sites)}")
        _positive(f"layers.C_per_site.{s}", c)
    for follower, leader in tied_sites(cfg).items():
        c_f, c_l = lay.C_per_site.get(follower, lay.C), lay.C_per_site.get(leader, lay.C)
        if c_f != c_l:
            raise ConfigError(f"layers.C_per_site.{follower}", c_f,
                              f"tied to {leader}: needs its C ({c_l}), or set layers.tie=false")
    _choice("layers.ci_fn", lay.ci_fn, CI_FN_TYPES)
    for h in lay.ci_hidden:
        _positive("layers.ci_hidden", h)

    lo = cfg.loss
    for key in ("faithfulness_coeff", "imp_min_coeff", "beta", "eps"):
        _positive(f"loss.{key}", getattr(lo, key), zero_ok=True)
    _positive("loss.p_start", lo.p_start)
    _positive("loss.p_end", lo.p_end)
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
        _positive(f"{k}.coeff", t.coeff, zero_ok=True)
        _choice(f"{k}.plan", t.plan, PLANS)
        _choice(f"{k}.source", t.source, SOURCES)
        _choice(f"{k}.routing", t.routing, ROUTINGS)
        if t.plan == "chunkwise" and not 1 <= t.sites_per_chunk <= len(lay.sites):
            raise ConfigError(f"{k}.sites_per_chunk", t.sites_per_chunk,
                              f"must be in 1..{len(lay.sites)} (the number of sites)")

    o = cfg.optim
    _positive("optim.steps", o.steps)
    _positive("optim.faith_warmup_steps", o.faith_warmup_steps, zero_ok=True)
    _positive("optim.faith_warmup_lr", o.faith_warmup_lr)
    for group in ("components", "ci_fn"):
        g: OptGroupConfig = getattr(o, group)
        _positive(f"optim.{group}.lr", g.lr)
        _choice(f"optim.{group}.schedule", g.schedule, SCHEDULES)
        _fraction(f"optim.{group}.warmup_frac", g.warmup_frac)
        _fraction(f"optim.{group}.final_frac", g.final_frac)
        _fraction(f"optim.{group}.b1", g.b1)
        _fraction(f"optim.{group}.b2", g.b2)
        _positive(f"optim.{group}.weight_decay", g.weight_decay, zero_ok=True)
        _positive(f"optim.{group}.clip_norm", g.clip_norm, zero_ok=True)

    _positive("data.batch_size", cfg.data.batch_size)
    _positive("data.eval_batches", cfg.data.eval_batches)
    _choice("gate.target", cfg.gate.target, GATE_TARGETS)
    me = cfg.mesh
    _positive("mesh.data", me.data, zero_ok=True)
    _positive("mesh.hosts", me.hosts)
    _positive("mesh.gpus_per_host", me.gpus_per_host, zero_ok=True)
    planned = me.hosts * max(me.gpus_per_host, 1)
    if me.data and cfg.gate.target != "local" and me.data != planned:
        raise ConfigError("mesh.data", me.data, f"must be 0 or mesh.hosts x mesh.gpus_per_host "
                          f"({planned}) for gate.target={cfg.gate.target}")
    if n_devices is not None and me.gpus_per_host and planned > n_devices:
        raise ConfigError("mesh.gpus_per_host", me.gpus_per_host,
                          f"mesh.hosts x mesh.gpus_per_host = {planned} devices; the job has "
                          f"{n_devices}")
    if n_devices is not None and me.data:
        if me.data > n_devices:
            raise ConfigError("mesh.data", me.data, f"the job has {n_devices} device(s)")
        if cfg.data.batch_size % me.data:
            raise ConfigError("data.batch_size", cfg.data.batch_size,
                              f"must be divisible by the data axis size {me.data}")
    if cfg.gate.target != "local" and cfg.data.batch_size % planned:
        raise ConfigError("data.batch_size", cfg.data.batch_size,
                          f"must be divisible by the {planned} {cfg.gate.target} GPUs of the mesh")

    mem = cfg.memory
    _positive("memory.hbm_cap_gib", mem.hbm_cap_gib, zero_ok=True)
    if not 0.0 < mem.safety_fraction <= 1.0:
        raise ConfigError("memory.safety_fraction", mem.safety_fraction, "must be in (0, 1]")
    _choice("memory.compute_dtype", mem.compute_dtype, DTYPES)
    g = cfg.gate
    _choice("gate.fit", g.fit, FIT_MODES)
    _positive("gate.fit_max_batch", g.fit_max_batch)
    _positive("gate.top_temps", g.top_temps, zero_ok=True)
    _positive("gate.calibrate_after", g.calibrate_after)
    _positive("logging.log_every", cfg.logging.log_every)
    _positive("logging.ckpt_every", cfg.logging.ckpt_every, zero_ok=True)


def tied_sites(cfg: RunConfig) -> dict[str, str]:
    """follower → leader for the decomposed sites whose weights the target ties."""
    if not cfg.layers.tie or cfg.model.kind != "tms":
        return {}
    chosen = set(cfg.layers.sites)
    return {"linear2": "linear1"} if {"linear1", "linear2"} <= chosen else {}


def site_C(cfg: RunConfig) -> dict[str, int]:
    """Components per decomposed site, in the target's canonical site order."""
    chosen = set(cfg.layers.sites)
    return {s: cfg.layers.C_per_site.get(s, cfg.layers.C)
            for s in site_names_of(cfg.model) if s in chosen}


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build the frozen dataclass `cls` from plain nested dicts (e.g. a resolved Hydra config).

    Unknown keys raise ConfigError naming the dotted key.
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(dotted, value, f"unknown key; known: {', '.join(sorted(names))}")
        kwargs[key] = _convert(hints[key], value, dotted)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, dotted: str) -> Any:
    origin = typing.get_origin(tp)
    if is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(dotted, value, f"must be a mapping of {tp.__name__} fields")
        return from_dict(tp, value, dotted + ".")
    if origin is dict and isinstance(value, Mapping):
        _, vt = typing.get_args(tp)
        return {k: _convert(vt, v, f"{dotted}.{k}") for k, v in value.items()}
    if origin is list and isinstance(value, (list, tuple)):
        (vt,) = typing.get_args(tp)
        return [_convert(vt, v, dotted) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(dotted, value, f"must be of type {tp.__name__}")
    return value

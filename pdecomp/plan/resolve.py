"""A run resolved once: the validated `RunConfig` turned into the frozen `Run` that every
layer below the front end reads (the bound kind, the sites with their C, the batch plan, the
placement, the memory policy, the step spec, absolute paths, provenance).

    run = resolve(cfg, n_devices)      # cfg as composed and validated
    run.batch.size, run.batch.microbatches, run.placement.deviceless, run.step, ...

Nothing here checks: `pdecomp.plan.validation.validate` has, before. A change the gate's searches
make (another batch, other microbatches) is a new `Run` (`with_batch`, `with_microbatches`),
resolved the same way, never a rewritten config.
"""

from __future__ import annotations

import dataclasses as dc
import functools
import platform
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from pdecomp.core.config import RunConfig
from pdecomp.core.memory import MemoryPolicy
from pdecomp.core.sharding import Placement, is_deviceless, planned_gpus
from pdecomp.kinds import EvalSpec, Kind, kind_of, site_C, tied_sites
from pdecomp.spd import terms
from pdecomp.spd.step import Method, Sites, StepSpec


@dataclass(frozen=True)
class BatchPlan:
    """How a step's examples are taken: `size` over the whole mesh, in `microbatches` pieces
    in turn, split on a data axis of `data_axis` devices (None: not known before the job)."""

    size: int
    microbatches: int
    data_axis: int | None

    @property
    def microbatch(self) -> int:
        """Examples in one microbatch, over the whole data axis."""
        return self.size // self.microbatches


@dataclass(frozen=True)
class Run:
    """Everything a run is, resolved: what every function below the front end takes."""

    config: RunConfig  # as resolved: settled microbatches, absolute paths (run.json)
    composed: RunConfig  # as the user composed it (config.yaml)
    kind: Kind
    sites: Mapping[str, int]  # components per decomposed site, in the target's order
    tied: Mapping[str, str]  # follower -> leader
    batch: BatchPlan
    placement: Placement
    step: StepSpec
    evaluation: EvalSpec

    def with_batch(self, size: int) -> Run:
        """This run at another global batch (the gate's batch search)."""
        data = dc.replace(self.config.data, batch_size=size)
        return resolve(dc.replace(self.config, data=data), self.placement.n_devices,
                       composed=self.composed)

    def with_microbatches(self, m: int) -> Run:
        """This run taken in `m` microbatches (the gate's microbatch search)."""
        optim = dc.replace(self.config.optim, microbatches=m)
        return resolve(dc.replace(self.config, optim=optim), self.placement.n_devices,
                       composed=self.composed)

    def with_mesh(self, model: int) -> Run:
        """This run with `model` devices on the model axis and the rest on data (the gate's
        mesh search)."""
        mesh = dc.replace(self.config.mesh, model=model, data=0)
        return resolve(dc.replace(self.config, mesh=mesh), self.placement.n_devices,
                       composed=self.composed)

    def record(self) -> dict[str, Any]:
        """What run.json holds: the resolved config and what was derived from it."""
        return {"config": dc.asdict(self.config), "kind": self.config.model.kind,
                "sites": dict(self.sites), "tied": dict(self.tied),
                "batch": dc.asdict(self.batch) | {"microbatch": self.batch.microbatch},
                "placement": {k: v for k, v in dc.asdict(self.placement).items() if k != "mesh"},
                "provenance": provenance()}


def resolve(cfg: RunConfig, n_devices: int | None = None, *,
            composed: RunConfig | None = None) -> Run:
    """The `Run` of a validated config. `n_devices`: the job's devices where known (None:
    not known, or a deviceless gate, whose mesh is the planned hosts x GPUs)."""
    deviceless = is_deviceless(cfg.gate)
    n = None if deviceless else n_devices
    composed = composed or cfg
    cfg = absolute_paths(with_microbatch_size(cfg, n))
    kind = kind_of(cfg.model)
    sites = site_C(cfg.model, cfg.layers)
    tied = tied_sites(cfg.model, cfg.layers)
    batch = BatchPlan(cfg.data.batch_size, cfg.optim.microbatches, data_axis(cfg, n))
    placement = Placement(cfg.mesh, cfg.gate.target, deviceless, n, batch.data_axis)
    step = step_spec(cfg, kind, sites, tied)
    evaluation = EvalSpec(cfg.loss.ci_threshold, cfg.layers.delta, cfg.memory.compute_dtype,
                          cfg.memory.logits_chunk, cfg.loss.eval_pgd)
    return Run(cfg, composed, kind, sites, tied, batch, placement, step, evaluation)


def data_axis(cfg: RunConfig, n_devices: int | None) -> int | None:
    """The size of the mesh's data axis, where the config and the job's device count (None:
    not known here) settle it, by `sharding.make_mesh`'s rules: `mesh.data`; else the planned
    hosts x GPUs per host over the model axis (`mesh.gpus_per_host`, or a named GPU target
    before devices are known); else the most devices per model-axis group that split each
    microbatch into whole examples (`optim.microbatch_size` of them each, when set)."""
    me, o = cfg.mesh, cfg.optim
    if me.data:
        return me.data
    if me.gpus_per_host or (cfg.gate.target != "local" and n_devices is None):
        return planned_gpus(me)[1] // me.model
    if n_devices is None:
        return None
    micro = cfg.data.batch_size // o.microbatches

    def splits(k: int) -> bool:
        return (cfg.data.batch_size % (o.microbatch_size * k) == 0 if o.microbatch_size
                else micro % k == 0)

    return max(k for k in range(1, n_devices // me.model + 1) if splits(k))


def with_microbatch_size(cfg: RunConfig, n_devices: int | None) -> RunConfig:
    """`optim.microbatch_size` turned into `optim.microbatches` for this mesh (the config
    unchanged without one, or where the data axis is not known yet)."""
    per = cfg.optim.microbatch_size
    if per <= 0 or cfg.optim.microbatches != 1:
        return cfg  # none asked for, or already settled (validate names a conflict)
    axis = data_axis(cfg, n_devices)
    if axis is None or cfg.data.batch_size % (per * axis):
        return cfg  # not known yet, or validate names what does not divide
    m = cfg.data.batch_size // (per * axis)
    return dc.replace(cfg, optim=dc.replace(cfg.optim, microbatches=m))


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """`model.path` and `data.path` made absolute against the working directory, so the run
    directory can be read (analysis, a resume) from anywhere."""
    model, data = cfg.model, cfg.data
    if getattr(model, "path", ""):
        model = dc.replace(model, path=str(Path(model.path).expanduser().absolute()))
    if data.path:
        data = dc.replace(data, path=str(Path(data.path).expanduser().absolute()))
    return dc.replace(cfg, model=model, data=data)


def step_spec(cfg: RunConfig, kind: Kind, sites: Mapping[str, int],
              tied: Mapping[str, str]) -> StepSpec:
    """What the train step reads of the run: every group of it, in the step's terms."""
    lo, names = cfg.loss, tuple(sites)
    p = ((lo.gamma_start, lo.gamma_end) if lo.imp_min_penalty == "smooth_l0"
         else (lo.p_start, lo.p_end))
    method = Method(
        ci=cfg.layers, delta=cfg.layers.delta, terms=terms.of(lo, names),
        pgd=lo.pgd if lo.pgd.coeff > 0 else None, distance=lo.distance,
        faith_coeff=lo.faithfulness_coeff, imp_coeff=lo.imp_min_coeff,
        p=(*p, lo.p_anneal_start_frac, lo.p_anneal_end_frac), beta=lo.beta, eps=lo.eps,
        penalty=lo.imp_min_penalty, ci_threshold=lo.ci_threshold)
    return StepSpec(
        sites=Sites(names, tuple(sites.values()), tuple(tied.items()), cfg.layers.tie_update),
        method=method, memory=MemoryPolicy.of(cfg.memory), optim=cfg.optim,
        total_steps=cfg.optim.steps, microbatches=cfg.optim.microbatches,
        positions=kind.positions(cfg.data, cfg.data.batch_size))


def _commit(root: Path) -> str | None:
    """The commit the code under `root` is from, `-dirty` if changed since; a copy taken for
    a queued SLURM job (launcher.snapshot) says it in its COMMIT file (its own git, if any,
    would be the sweep directory's)."""
    recorded = root / "COMMIT"
    if recorded.is_file():
        return recorded.read_text().strip() or None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "pdecomp", "launcher"], check=True, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


@functools.cache
def provenance() -> dict[str, str | None]:
    """What made the run: pdecomp's version, the commit of its checkout (None outside one),
    Python's and jax's versions."""
    commit = _commit(Path(__file__).resolve().parents[2])
    try:
        version = metadata.version("pdecomp")
    except metadata.PackageNotFoundError:
        version = None
    return {"pdecomp": version, "commit": commit, "python": platform.python_version(),
            "jax": jax.__version__}


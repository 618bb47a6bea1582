"""A whole decomposition from a RunConfig: target → mesh → gate → state → train → results.

Front ends (the Hydra launcher, a notebook) call `decompose`; logging backends plug in
through `on_metrics`. Results land in `run_dir`: gate.json, summary.json, plots, checkpoints.
"""

from __future__ import annotations

import dataclasses as dc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from pdecomp import gate as gate_lib
from pdecomp import hardware, hosts, metrics, plots, sharding, storage
from pdecomp.checkpoint import Checkpointer, UnreadableCheckpoint
from pdecomp.components import with_tied
from pdecomp.config import EVAL_SEED_OFFSET, ConfigError, RunConfig
from pdecomp.kinds import EvalSpec, kind_of, tied_sites
from pdecomp.llama import SITE_LAYER_SAVES
from pdecomp.train import (
    StepSpec,
    TrainState,
    faithfulness_warmup,
    init_state,
    make_train_step,
)
from pdecomp.units import GiB, fmt_bytes
from pdecomp.validation import validate


class Interrupted(RuntimeError):
    """Training stopped early at `step` because the front end asked (a scheduler's signal);
    a checkpoint at that step is complete on disk."""

    def __init__(self, step: int, checkpoint_dir: Path):
        self.step = step
        super().__init__(f"stopped at step {step}; checkpoint in {checkpoint_dir}")


class NonFiniteLoss(FloatingPointError):
    """Training produced a NaN or an infinity; what was checkpointed before it is intact."""


class GateRefused(RuntimeError):
    def __init__(self, report: dict[str, Any]):
        self.report = report
        what = {"batch": "no batch", "microbatches": "no microbatch count"}
        why = (f"{what[report['fit']['mode']]} fits (gate.fit={report['fit']['mode']}): "
               f"{report['fit']['why']}" if "fit" in report
               else f"predicted peak {fmt_bytes(report['peak_bytes'])} > cap "
                    f"{fmt_bytes(report['cap_bytes'])} per device")
        most = report.get("max_microbatches", 0)
        if "fit" not in report and report.get("microbatches", most) < most:
            why += (f"; up to {most} microbatches would hold fewer activations "
                    "(gate.fit=microbatches finds the fewest that fit)")
        saves = list(SITE_LAYER_SAVES)  # most kept first
        kept = report.get("site_layer_saves")
        lighter = " or ".join(saves[saves.index(kept) + 1:]) if kept in saves else ""
        if "fit" not in report and lighter:
            why += (f"; memory.site_layer_saves={lighter} would keep fewer of the site layers' "
                    "activations, at more FLOPs")
        super().__init__(f"gate refused: {why}")


# The argument part of the optimizer moments, and its name when they live in host memory.
OPT_PART, OPT_PART_HOST = "optimizer moments", "optimizer moments (host)"


@dataclass
class Hooks:
    """Callbacks a front end supplies; all optional."""

    log: Callable[[str], None] = print
    on_metrics: Callable[[int, dict[str, float]], None] | None = None
    on_gate: Callable[[dict[str, Any]], None] | None = None
    progress: Callable[[int, int, dict[str, float]], None] | None = None
    # Asked every `logging.stop_check_every` steps; True on any process stops every process
    # at that step, with a checkpoint (raises Interrupted).
    should_stop: Callable[[], bool] | None = None
    # The front end ends the process with gate.end_process after a gate-only run, so a
    # deviceless gate may report from XLA's buffer assignment and leave code generation
    # running (gate.compile_and_report, detach).
    detach_gate: bool = False
    # Process-wide, so the front end's to ask for: on a CPU backend, glibc keeps freed
    # blocks for reuse (hardware.keep_freed_host_memory: the toys' steps 40% faster) from
    # training on. A library caller's process is left as it was.
    keep_freed_host_memory: bool = False
    # Process-wide likewise: orbax's tracebacks for a checkpoint failure that the run
    # reports itself are dropped (Checkpointer's `quiet`).
    quiet_checkpoint_failures: bool = False


def write_json(path: Path, obj: Any) -> None:
    """Write atomically: a reader never sees half a file; WriteFailed on a full disk. Rank 0
    only."""
    if hosts.is_main_process():
        storage.write_text(path, json.dumps(obj, indent=1, default=_jsonable))


CONFIG_FILE = "config.yaml"  # the resolved RunConfig, which `pdecomp.runs.load_run` reads


def write_config(cfg: RunConfig, run_dir: Path) -> None:
    """The resolved config as plain YAML (tuples as lists), atomically. Rank 0 only."""
    if not hosts.is_main_process():
        return
    plain = json.loads(json.dumps(dc.asdict(cfg)))
    storage.write_text(run_dir / CONFIG_FILE,
                       yaml.safe_dump(plain, sort_keys=False, allow_unicode=True))


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.generic, jax.Array)):
        return np.asarray(x).tolist()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x))


def measured_memory(mesh: Mesh) -> tuple[int, int] | None:
    """(peak, in use) bytes, the largest over this host's devices, where the backend reports
    them (GPUs do; XLA:CPU does not)."""
    stats = [d.memory_stats() or {} for d in mesh.devices.flat
             if d.process_index == jax.process_index()]
    stats = [s for s in stats if "peak_bytes_in_use" in s]
    if not stats:
        return None
    return (max(s["peak_bytes_in_use"] for s in stats), max(s["bytes_in_use"] for s in stats))


def calibrate(report: dict[str, Any], mesh: Mesh) -> bool:
    """Put the measured peak beside the prediction; False where none is reported."""
    measured = measured_memory(mesh)
    if measured is None:
        return False
    report["measured_peak_bytes"] = int(measured[0])
    report["predicted_over_measured"] = report["peak_bytes"] / measured[0]
    return True


def note_peak(g: Gated, phase: str) -> None:
    """The measured peak so far (it only grows) at the end of `phase`, in the gate's report:
    which phase set the run's peak, against the step the gate predicted."""
    if (measured := measured_memory(g.mesh)) is not None:
        g.report.setdefault("measured_peak_by_phase_bytes", {})[phase] = int(measured[0])


def gate_cap(cfg: RunConfig, mesh: Mesh) -> tuple[int, str, dict[str, Any] | None]:
    """The per-device cap and where it came from (`gate.device_cap_bytes`; for a deviceless
    target, the card's memory from the hardware table x the usable fraction, the pool a job
    on it will have), and for a GPU the usable-memory record for gate.json (None elsewhere:
    the allocator settings are a GPU's)."""
    mem = cfg.memory
    usable = hardware.usable_memory(mem.safety_fraction)
    deviceless = sharding.is_deviceless(cfg.gate)
    gpu = deviceless or mesh.devices.flat[0].platform == "gpu"
    if mem.hbm_cap_gib <= 0 and deviceless:
        spec = hardware.GPUS[cfg.gate.target]
        cap = int(spec.memory_bytes * usable.fraction)
        source = f"{cfg.gate.target} {spec.memory_gib:.1f} GiB x {usable.fraction}"
    else:
        cap, source = gate_lib.device_cap_bytes(mesh.local_devices[0], mem.hbm_cap_gib,
                                                mem.safety_fraction, usable)
    if not gpu:
        return cap, source, None
    if mem.hbm_cap_gib > 0 and deviceless:
        pool = int(hardware.GPUS[cfg.gate.target].memory_bytes * usable.fraction)
        if cap > pool:  # the gate's yes would not be the job's
            source += f" (above the {fmt_bytes(pool)} the job's allocator may use)"
    return cap, f"{source}; {usable.describe()}", usable.record()


def target_name(cfg: RunConfig, mesh: Mesh) -> str:
    device = mesh.devices.flat[0]
    hosts = len({d.process_index for d in mesh.devices.flat})
    where = "deviceless" if sharding.is_deviceless(cfg.gate) else "local"
    return f"{where} {device.device_kind} x {mesh.size} ({hosts} host{'s' * (hosts > 1)})"


def preflight(cfg: RunConfig, run_dir: str | Path | None = None) -> None:
    """The checks that need this job's devices or files; raises ConfigError before anything
    is made. With `run_dir`: a checkpoint there, which the run would resume, must fit the
    state this config builds."""
    # The allocator settings of the environment, before jax's GPU client would refuse them.
    hardware.usable_memory(cfg.memory.safety_fraction)
    validate(cfg, n_devices=None if sharding.is_deviceless(cfg.gate) else len(jax.devices()))
    sharding.check_target(cfg.gate)
    if not sharding.is_deviceless(cfg.gate):
        sharding.make_mesh(cfg)  # its checks: every process of the job has devices in it
    if not cfg.gate.only:  # the gate needs shapes only, not the data
        kind_of(cfg.model).preflight(cfg.model, cfg.data, cfg.seed)
    if run_dir is not None and not cfg.gate.only:
        check_resumable(cfg, Path(run_dir))


def check_resumable(cfg: RunConfig, run_dir: Path) -> None:
    """A run directory's newest readable checkpoint (the one the run resumes from) has the
    arrays this config trains, or it is an error naming the first that differs (a changed
    layers.C, layers.sites, model, ...)."""
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        return
    ckpt = Checkpointer(ckpt_dir)
    state_abs = abstract_run(cfg, jax.random.PRNGKey(cfg.seed))[1]
    why, resumed = None, None
    for step in ckpt.steps_newest_first():
        try:
            why = ckpt.mismatch(state_abs, step)
            resumed = step
            break
        except UnreadableCheckpoint:
            continue
    ckpt.close()
    if why:
        raise ConfigError("hydra.run.dir", str(run_dir), f"its checkpoint at step {step} {why}")
    if resumed is not None and not cfg.optim.allow_schedule_change:
        check_schedule(cfg, run_dir, resumed)


# The settings that are functions of the step, each laid out over optim.steps: the
# learning-rate schedules (components, CI function, PGD sources) and p's annealing. A
# resumed run that changed one would go on along another curve than its first steps took.
SCHEDULE_KEYS = ("optim.steps",
                 *(f"optim.{group}.{key}" for group in ("components", "ci_fn")
                   for key in ("lr", "schedule", "warmup_frac", "final_frac")),
                 "loss.pgd.lr", "loss.pgd.warmup_frac", "loss.p_start", "loss.p_end",
                 "loss.p_anneal_start_frac", "loss.p_anneal_end_frac")


def check_schedule(cfg: RunConfig, run_dir: Path, step: int) -> None:
    """A resume keeps the schedule its run was trained on (the run directory's config.yaml),
    or it is an error naming the first key that differs."""
    import yaml

    saved = run_dir / "config.yaml"
    try:
        before = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return  # no record to hold the run to (a run directory from before config.yaml)
    now = dc.asdict(cfg)
    for key in SCHEDULE_KEYS:
        old, new = _at(before, key), _at(now, key)
        if old is not None and not _same(old, new):
            raise ConfigError(key, new, f"the run in {run_dir} was trained to its checkpoint at "
                              f"step {step} with {key}={old!r}, and resuming with another "
                              f"value changes its schedule under it; keep {old!r}, or set "
                              "optim.allow_schedule_change=true")


def _at(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _same(a: Any, b: Any) -> bool:
    """Equal as values: YAML may hold 0.001 where the config has 1e-3 (or an int for 2.0)."""
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    except (TypeError, ValueError):
        return a == b


def abstract_run(cfg: RunConfig, key: Array) -> tuple[Any, TrainState]:
    """The target and the training state as shapes: nothing allocated, nothing trained."""
    target_abs = jax.eval_shape(lambda k: kind_of(cfg.model).init_target(
        k, cfg.model, jnp.dtype(cfg.memory.target_dtype)), key)
    spec = StepSpec.from_config(cfg)
    return target_abs, jax.eval_shape(lambda k, t: init_state(k, spec, t), key, target_abs)


def load_target(cfg: RunConfig, target_abs: Any, log: Callable[[str], None]
                ) -> tuple[Any, dict[str, Any]]:
    """The frozen target, in the shardings of `target_abs`, as its kind loads it."""
    return kind_of(cfg.model).load(cfg.model, cfg.layers, cfg.memory.target_dtype,
                                   sharding.shardings(target_abs), log)


@dataclass
class Gated:
    """What the gate leaves for training: the mesh and shardings, the abstract target and
    state, the compiled step and its report, and the config it was compiled for (its batch
    size the one gate.fit=batch chose) with the step's part of it resolved."""

    cfg: RunConfig
    spec: StepSpec
    mesh: Mesh
    batch_sharding: NamedSharding
    target_abs: Any
    state_abs: TrainState
    compiled: Any
    report: dict[str, Any]
    init_key: Array
    data_key: Array


def decompose(cfg: RunConfig, run_dir: str | Path, hooks: Hooks | None = None) -> dict[str, Any]:
    """Run (or resume) the decomposition described by `cfg`; return the summary dict.

    A file that cannot be written (a full disk) raises storage.WriteFailed, a checkpoint
    checkpoint.CheckpointWriteFailed: the last complete checkpoint is intact, and running
    again in `run_dir` resumes from it."""
    hooks = hooks or Hooks()
    run_dir = Path(run_dir)
    cfg = sharding.with_microbatch_size(cfg, None if sharding.is_deviceless(cfg.gate)
                                        else len(jax.devices()))
    preflight(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(cfg, run_dir)

    g = gate(cfg, run_dir, hooks)
    if g.cfg.gate.only:
        return {"gate": g.report}
    cfg = g.cfg
    target, target_meta = load_target(cfg, g.target_abs, hooks.log)
    note_peak(g, "target loaded")
    # Only now: kept from the start, the loader's freed host copies (stacking the layers'
    # tensors: 0.44 GB for SmolLM2's 0.54 GB) stayed resident for the whole run.
    if hooks.keep_freed_host_memory and jax.default_backend() == "cpu":
        hardware.keep_freed_host_memory()
    ckpt = Checkpointer(run_dir / "checkpoints", writer=True,
                        quiet=hooks.quiet_checkpoint_failures)
    state, start = initial_state(cfg, g, target, ckpt, hooks.log)
    note_peak(g, "initial state")
    state, history = train(cfg, g, target, state, start, ckpt, run_dir, hooks)
    note_peak(g, "training")
    # Evaluation reads the components and the CI function alone: the optimizer's moments
    # and the adversary (in the last checkpoint) are let go before it allocates anything.
    steps, learned = int(state.step), Learned(state.components, state.ci_fn)
    del state

    summary, evaluated = evaluate(cfg, target, learned, g.batch_sharding)
    note_peak(g, "evaluation")
    summary.update(draw(cfg, evaluated, history, run_dir))
    last = history[-1] if history else {}
    summary.update({k: v for k, v in last.items() if k.startswith(("loss/", "perf/"))})
    summary["steps"] = steps
    summary["target/seed"] = target_meta.get("seed")
    if calibrate(g.report, g.mesh):  # the whole run's peak, evaluation included
        write_json(run_dir / "gate.json", g.report)
        summary["hbm/predicted_over_measured"] = g.report["predicted_over_measured"]
    write_json(run_dir / "summary.json", summary)
    write_json(run_dir / "history.json", history)
    return summary


def gate(cfg: RunConfig, run_dir: Path, hooks: Hooks) -> Gated:
    """The mesh, the abstract target and state in their shardings, and the gate: compile the
    very step training runs, read its memory, compare to the cap (gate.json; GateRefused when
    it does not fit). gate.fit=batch first searches the largest batch that fits,
    gate.fit=microbatches the fewest microbatches."""
    # The batch split on the data axis; target and state split on it too (mesh.shard_state,
    # FSDP) or replicated.
    mesh = sharding.make_mesh(cfg)
    layout = sharding.make_layout(cfg.mesh, mesh)
    init_key, data_key = jax.random.split(jax.random.PRNGKey(cfg.seed))
    target_abs, state_abs = abstract_run(cfg, init_key)
    target_abs = sharding.place(target_abs, layout)
    state_abs = sharding.place(state_abs, layout, sharding.OFFLOADED
                               if cfg.memory.offload_opt_state else ())
    batch_sharding = NamedSharding(mesh, P(sharding.AXIS))

    cap, cap_source, memory_env = gate_cap(cfg, mesh)
    # Host-memory (offload) buffers are not told apart in XLA's dump: offload compiles whole.
    detach = (hooks.detach_gate and cfg.gate.only and cfg.gate.fit == "none"
              and sharding.is_deviceless(cfg.gate) and cfg.memory.remat != "offload")
    where = {"cap_bytes": cap, "cap_source": cap_source, "target": target_name(cfg, mesh),
             "mesh": dict(mesh.shape)}
    extra = {"memory_env": memory_env} if memory_env else {}

    def batch_at(batch_size: int) -> jax.ShapeDtypeStruct:
        return kind_of(cfg.model).batch_abstract(cfg.model, cfg.data, batch_size,
                                                 batch_sharding)

    def parts_at(batch_size: int) -> dict[str, int]:
        return argument_parts(cfg, target_abs, state_abs, batch_at(batch_size))

    def floor_at(batch_size: int) -> dict[str, Any]:
        parts = parts_at(batch_size)
        # moments offloaded to the host are not device bytes on a GPU: left out of the bound
        device_bytes = sum(v for k, v in parts.items() if k != OPT_PART_HOST)
        report = gate_lib.uncompiled_report(argument_bytes=device_bytes, parts=parts, **where)
        return {**report, "batch_size": batch_size, **extra}

    def compile_at(batch_size: int, c: RunConfig = cfg):
        compiled, report = gate_lib.compile_and_report(
            make_train_step(StepSpec.from_config(c), layout),
            (state_abs, target_abs, batch_at(batch_size)),
            donate_argnums=(0,) if cfg.memory.donate else (),
            out_shardings=(sharding.shardings(state_abs), NamedSharding(mesh, P())),
            parts=parts_at(batch_size), top_temps=cfg.gate.top_temps, detach=detach, **where)
        report.update(batch_size=batch_size, **extra)
        if cfg.memory.offload_opt_state and sharding.is_deviceless(cfg.gate):
            # Compile-only devices have no host memory space: jax drops the memory kind.
            report["note"] = ("memory.offload_opt_state: a deviceless compile has no host "
                              "memory, so the optimizer moments count as device arguments "
                              "here (an upper bound; on the GPUs they are host arguments)")
        return compiled, report

    if cfg.gate.fit == "batch":
        batch_size, compiled, report = gate_lib.fit_batch(
            compile_at, cfg.data.batch_size, mesh.size * cfg.optim.microbatches,
            cfg.gate.fit_max_batch, floor_at)
        cfg = dc.replace(cfg, data=dc.replace(cfg.data, batch_size=batch_size))
        if report["fits"]:  # a refusal says why in its own line
            hooks.log(f"gate.fit=batch: data.batch_size={batch_size}: {report['fit']['why']}")
    elif cfg.gate.fit == "microbatches":
        def with_micro(m: int) -> RunConfig:
            return dc.replace(cfg, optim=dc.replace(cfg.optim, microbatches=m))

        m, compiled, report = gate_lib.fit_microbatches(
            lambda m: compile_at(cfg.data.batch_size, with_micro(m)),
            sharding.microbatch_counts(cfg.data.batch_size, mesh.shape[sharding.AXIS]))
        cfg = with_micro(m)
        if report["fits"]:
            hooks.log(f"gate.fit=microbatches: optim.microbatches={m}: {report['fit']['why']}")
    else:
        compiled, report = compile_at(cfg.data.batch_size)
    # the most microbatches: one example per data-axis device in each, and what the
    # rematerialized site layers keep (a refusal's hints)
    report.update(microbatches=cfg.optim.microbatches,
                  max_microbatches=cfg.data.batch_size // mesh.shape[sharding.AXIS],
                  site_layer_saves=cfg.memory.site_layer_saves if cfg.memory.remat_layers
                  else None)
    write_json(run_dir / "gate.json", report)
    if hooks.on_gate:
        hooks.on_gate(report)
    if not report["fits"]:
        raise GateRefused(report)
    return Gated(cfg, StepSpec.from_config(cfg), mesh, batch_sharding, target_abs, state_abs,
                 compiled, report, init_key, data_key)


def argument_parts(cfg: RunConfig, target_abs: Any, state_abs: TrainState, batch_abs: Any
                   ) -> dict[str, int]:
    """The step's argument bytes per device by part, counted from shapes and shardings."""
    return {"frozen target": gate_lib.tree_bytes(target_abs),
            "components": gate_lib.tree_bytes(state_abs.components),
            "ci function": gate_lib.tree_bytes(state_abs.ci_fn),
            OPT_PART_HOST if cfg.memory.offload_opt_state else OPT_PART:
                gate_lib.tree_bytes((state_abs.comp_opt, state_abs.ci_opt)),
            "adversary": gate_lib.tree_bytes(state_abs.adversary),
            "step and key": gate_lib.tree_bytes((state_abs.step, state_abs.key)),
            "batch": gate_lib.tree_bytes(batch_abs)}


def initial_state(cfg: RunConfig, g: Gated, target: Any, ckpt: Checkpointer,
                  log: Callable[[str], None]) -> tuple[TrainState, int]:
    """The latest readable checkpoint and its step, or a fresh state (the components after
    the faithfulness warmup) and 0."""
    state, start = ckpt.restore_latest(g.state_abs, log)
    if start is not None:
        log(f"resumed from checkpoint at step {start}")
        return state, start
    # The target goes in as an argument: closed over, it would be copied into the program
    # as a constant, which a target split across processes cannot be.
    state = jax.jit(lambda k, t: init_state(k, g.spec, t),
                    out_shardings=sharding.shardings(g.state_abs))(g.init_key, target)
    components = jax.jit(lambda c, t: faithfulness_warmup(g.spec, c, t),
                         out_shardings=sharding.shardings(g.state_abs.components))(
        state.components, target)
    return eqx.tree_at(lambda s: s.components, state, components), 0


def train(cfg: RunConfig, g: Gated, target: Any, state: TrainState, start: int,
          ckpt: Checkpointer, run_dir: Path, hooks: Hooks
          ) -> tuple[TrainState, list[dict[str, float]]]:
    """Steps start..optim.steps of the gated executable, each followed by what is due at its
    cadence: the metrics (every logging.log_every steps, the first and the last), the gate's
    calibration (once, gate.calibrate_after steps in), progress, the stop check (every
    logging.stop_check_every) and the checkpoint (every logging.ckpt_every, the last, a
    stop). Returns the final state and the metrics history."""
    sample = kind_of(cfg.model).batch_sampler(cfg.model, cfg.data, cfg.seed, g.batch_sharding,
                                              g.data_key)
    # With more simulated CPU devices than cores, in-flight steps can starve the collective
    # rendezvous of threads; waiting on each step avoids that.
    sync_each = jax.default_backend() == "cpu" and g.mesh.size > 1
    steps = cfg.optim.steps
    ckpt_every = cfg.logging.ckpt_every or steps
    log = MetricsLog.resume(run_dir, start)
    for i in range(start, steps):
        state, m = g.compiled(state, target, sample(i))
        if sync_each:
            jax.block_until_ready(m)
        done = i + 1
        if done % cfg.logging.log_every == 0 or done == steps or done == 1:  # 1: the start
            log.record(cfg, g, done, m, ckpt)
            if hooks.on_metrics:
                hooks.on_metrics(done, log.last)
        if done == start + cfg.gate.calibrate_after and calibrate(g.report, g.mesh):
            write_json(run_dir / "gate.json", g.report)
            if hooks.on_metrics:
                hooks.on_metrics(done, {
                    "hbm/measured_peak_gib": g.report["measured_peak_bytes"] / GiB,
                    "hbm/predicted_over_measured": g.report["predicted_over_measured"]})
        if hooks.progress:
            hooks.progress(done, steps, log.last)
        stop = (hooks.should_stop is not None and done % cfg.logging.stop_check_every == 0
                and hosts.any_process(hooks.should_stop()))
        if done % ckpt_every == 0 or done == steps or stop:
            checkpoint(ckpt, run_dir, done, state, log.history)
        if stop and done < steps:
            ckpt.close()  # waits until the checkpoint is complete on disk
            raise Interrupted(done, ckpt.directory)
    ckpt.close()
    return state, log.history


@dataclass
class MetricsLog:
    """The logged metrics: every logged step's, in order (history.json), and the latest."""

    history: list[dict[str, float]]
    last: dict[str, float]
    start: int
    t_log: float

    @staticmethod
    def resume(run_dir: Path, start: int) -> MetricsLog:
        """What the first attempt logged up to `start`, the step a resume starts from."""
        history: list[dict[str, float]] = []
        if start and (run_dir / "history.json").exists():
            history = [h for h in json.loads((run_dir / "history.json").read_text())
                       if h["step"] <= start]
        return MetricsLog(history, dict(history[-1]) if history else {}, start,
                          time.perf_counter())

    def record(self, cfg: RunConfig, g: Gated, done: int, m: dict[str, Array],
               ckpt: Checkpointer) -> None:
        """Step `done`'s metrics with its speed and memory; NonFiniteLoss on a NaN or inf."""
        last = {k: float(v) for k, v in m.items()}
        if not all(math.isfinite(v) for v in last.values()):
            ckpt.wait()  # a save in flight counts once it is complete
            saved = ckpt.steps_newest_first()
            ckpt.close()
            kept = (f"the last checkpoint, step {saved[0]} in {ckpt.directory}, is intact"
                    if saved else "no checkpoint was written before it")
            raise NonFiniteLoss(f"non-finite loss at step {done}: {last}; {kept}")
        now = time.perf_counter()
        n_steps = done - max(self.history[-1]["step"] if self.history else 0, self.start)
        last["perf/step_s"] = (now - self.t_log) / n_steps
        last["perf/examples_per_s"] = cfg.data.batch_size / last["perf/step_s"]
        if tokens := kind_of(cfg.model).tokens_per_example(cfg.data):
            last["perf/tokens_per_s"] = last["perf/examples_per_s"] * tokens
        self.t_log = now
        last["hbm/predicted_peak_gib"] = g.report["peak_bytes"] / GiB
        if measured := measured_memory(g.mesh):
            last["hbm/peak_gib"], last["hbm/in_use_gib"] = (b / GiB for b in measured)
        self.history.append({"step": done, **last})
        self.last = last


def checkpoint(ckpt: Checkpointer, run_dir: Path, step: int, state: TrainState,
               history: list[dict[str, float]]) -> None:
    """The history, then the state at `step` (saved in the background). The history first:
    a resume keeps its entries up to the checkpoint it starts from, so it must never be older
    than that checkpoint, also when a full disk stops the run between the two writes."""
    try:
        write_json(run_dir / "history.json", history)
    except storage.WriteFailed:
        ckpt.close()  # a save in flight that failed on the same disk is the fault to report
        raise
    ckpt.save(step, state)


class Learned(NamedTuple):
    """What a decomposition learned: all that evaluation reads of a training state."""

    components: Any
    ci_fn: Any


class Evaluated(NamedTuple):
    """What the final evaluation read, as it read it (a toy's gathered whole on every
    process), and its per-site CI summary: what `draw` plots."""

    target: Any
    components: Any
    ci: dict[str, dict[str, Any]]


def evaluate(cfg: RunConfig, target, state: Learned | TrainState, batch_sharding: NamedSharding
             ) -> tuple[dict[str, Any], Evaluated]:
    """Final metrics on fresh held-out batches: live components and L0 per site, then the
    kind's own (the ground-truth match of a toy, CE/KL per mask type of an LM). Numbers
    only, and what was evaluated."""
    kind = kind_of(cfg.model)
    eval_key = jax.random.PRNGKey(cfg.seed + EVAL_SEED_OFFSET)
    # In training's microbatches: a whole batch at once would need memory the step, which
    # takes it in optim.microbatches pieces, never did.
    n = cfg.optim.microbatches
    micro = dc.replace(cfg.data, batch_size=cfg.data.batch_size // n)
    sample = kind.batch_sampler(cfg.model, micro, cfg.seed, batch_sharding, eval_key,
                                held_out=True)
    batches = [sample(i) for i in range(cfg.data.eval_batches * n)]
    replicated = NamedSharding(batch_sharding.mesh, P())
    components = with_tied(state.components, tied_sites(cfg.model, cfg.layers))
    target, components, ci_fn = kind.for_evaluation((target, components, state.ci_fn),
                                                    replicated)
    ci = metrics.ci_summary(target, components, ci_fn, batches, cfg.loss.ci_threshold,
                            replicated)
    summary: dict[str, Any] = {}
    for s, v in ci.items():
        summary[f"live/{s}"] = v["live"]
        summary[f"l0/{s}"] = v["l0"]
    spec = EvalSpec(cfg.loss.ci_threshold, cfg.layers.delta, cfg.memory.compute_dtype,
                    cfg.loss.eval_pgd)
    summary.update(kind.evaluate(cfg.model, spec, target, components, ci_fn, batches,
                                 eval_key, ci))
    return summary, Evaluated(target, components, ci)


def draw(cfg: RunConfig, evaluated: Evaluated, history: list[dict[str, float]],
         run_dir: Path) -> dict[str, str]:
    """The result's plots (rank 0, `logging.plots`): summary key -> file drawn."""
    if not cfg.logging.plots or not hosts.is_main_process():
        return {}
    thr, ci = cfg.loss.ci_threshold, evaluated.ci
    out = {"plots/mean_ci": str(plots.plot_mean_ci(ci, run_dir / "mean_ci.png", thr))}
    if history:
        out["plots/history"] = str(plots.plot_history(history, run_dir / "history.png"))
    return out | kind_of(cfg.model).plots(evaluated.target, evaluated.components, ci, thr,
                                          run_dir)

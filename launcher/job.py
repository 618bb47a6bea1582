"""One job's lifecycle around `pdecomp.run.decompose.decompose`: its run directory, its
wandb run (launcher.wandb_run), its progress, and how it ends (what it prints:
launcher.printing)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from launcher import cluster, host, outcome, snapshot
from launcher.printing import console, gate_table, print_findings, temps_table
from launcher.registry import to_run_config
from launcher.wandb_run import WandbLogger, wandb_mode
from pdecomp.core.config import ConfigError, RunConfig
from pdecomp.core.exits import EXIT_BAD_CONFIG, EXIT_FAULT, EXIT_GATE_REFUSED, EXIT_REQUEUED
from pdecomp.core.storage import WriteFailed
from pdecomp.core.units import GiB
from pdecomp.gate.report import GateReport


def wandb_identity(job: Job) -> dict[str, Any]:
    """The run's name (`logging.wandb.name`, else the preset and what this job sets: in a
    sweep, the values it varies, so each job's name is its own), its group (the sweep's,
    shared by its jobs) and tags (the preset's name and `logging.wandb.tags`)."""
    w = job.cfg.logging.wandb
    parts = [job.preset or job.cfg.name, *job.varied]
    sweep = Path(job.sweep_dir)
    return {"name": w.name or " ".join(parts),
            "group": w.group or (f"{sweep.parent.name}/{sweep.name}" if job.multirun else None),
            "tags": [*w.tags, *([job.preset] if job.preset else [])]}


def wandb_config(job: Job) -> dict[str, Any]:
    """What the run's wandb config records: the composed config, and what made it."""
    from pdecomp.plan.resolve import provenance

    return {**job.resolved, "pdecomp": {**provenance(), "preset": job.preset,
                                        "overrides": job.overrides}}


def last_checkpoint(run_dir: Path) -> Path | None:
    """The run's latest complete checkpoint directory (`checkpoints/<step>`), if any."""
    from pdecomp.run.checkpoint import complete_steps

    ckpt_dir = run_dir / "checkpoints"
    steps = complete_steps(ckpt_dir) if ckpt_dir.is_dir() else []
    return ckpt_dir / str(steps[0]) if steps else None


def _discard(run_dir: Path) -> None:
    """Remove a run directory that holds only what Hydra wrote for a job that never ran."""
    hydra_only = all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir())
    if hydra_only:
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class Job:
    """One job as Hydra and the scheduler started it: its config, directory and place."""

    cfg: RunConfig
    resolved: dict[str, Any]  # the composed config as plain data (wandb's config)
    run_dir: Path
    multirun: bool
    sweep_dir: str
    in_slurm: bool
    ranks: cluster.Ranks
    preset: str | None  # the `+experiment=` it was composed with
    overrides: list[str]  # the job's overrides, as Hydra applied them
    varied: list[str]  # those a sweep varies (a single run: all of them)
    signals: cluster.StopSignals | None = None

    @property
    def rank0(self) -> bool:
        return self.ranks.process_id == 0

    @property
    def in_sweep(self) -> bool:
        """A job of an in-process sweep: the sweep's other jobs run whatever this one does."""
        return self.multirun and not self.in_slurm

    def ended(self, code: int, reason: str) -> dict[str, Any]:
        """A job that did not finish: a sweep's row says how; a single run exits with the
        code."""
        if self.rank0 and (self.multirun or self.in_slurm):
            with contextlib.suppress(WriteFailed):  # a full disk: the launcher says "failed"
                outcome.write(self.run_dir, code, reason)
        if self.in_sweep:
            return {"failed": True, "exit_code": code, "reason": reason}
        sys.exit(code)


def start_job(dict_cfg: DictConfig) -> Job:
    """The job's config and place; in a SLURM job, its tasks joined as one JAX runtime and
    the scheduler's signals caught (SIGTERM / Ctrl-C elsewhere)."""
    # orbax (through absl) and jax log routine events at INFO; keep the console for results.
    for name in ("absl", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)
    resolved = OmegaConf.to_container(dict_cfg, resolve=True, enum_to_str=True)
    hc = HydraConfig.get()
    in_slurm = cluster.in_slurm_job()
    multirun, overrides = hc.mode == RunMode.MULTIRUN, list(hc.overrides.task)
    job = Job(to_run_config(resolved), resolved, Path(hc.runtime.output_dir), multirun,
              str(hc.sweep.dir), in_slurm, cluster.job_ranks(),
              hc.runtime.choices.get("experiment"), overrides,
              varied(overrides, Path(hc.sweep.dir)) if multirun else shown(overrides))
    # A scheduler's signal, or SIGTERM / Ctrl-C, stops training at the next step boundary
    # with a checkpoint; the run resumes from it.
    if not (job.cfg.gate.only and not in_slurm):
        job.signals = cluster.StopSignals(in_slurm)
    if in_slurm:
        assert job.signals is not None
        job.signals.install()  # from the start: SLURM's signals would otherwise end the task
        cluster.init_distributed(job.ranks, job.cfg.mesh.init_timeout_s)
        cluster.say(job.ranks, f"job {os.environ['SLURM_JOB_ID']} on {os.uname().nodename}, "
                               f"node {job.ranks.node}/{job.ranks.num_nodes}, "
                               f"code {snapshot.code_root()}")
    return job


def shown(overrides: list[str]) -> list[str]:
    """The overrides that say what a run is: not the preset (named apart), Hydra's own
    settings or wandb's."""
    return [o for o in overrides if not o.lstrip("+~").startswith(
        ("experiment=", "hydra.", "hydra/", "logging."))]


def varied(overrides: list[str], sweep_dir: Path) -> list[str]:
    """This job's values of the keys its sweep varies (the sweep's own overrides are in
    `multirun.yaml`, which Hydra's sweeper writes before any job starts)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        swept = OmegaConf.load(sweep_dir / "multirun.yaml").hydra.overrides.task
    except (OSError, AttributeError):
        return shown(overrides)
    parser = OverridesParser.create()
    keys = {o.get_key_element() for o in parser.parse_overrides(list(swept))
            if o.is_sweep_override()}
    mine = [o for o in overrides if o.partition("=")[0] in keys]
    return mine or shown(overrides)


def gpus_asked() -> int:
    """The GPUs the job's launcher asked the scheduler for (`hydra.launcher.gpus_per_node`,
    or per task); 0 for a launcher that asks for none."""
    launcher = HydraConfig.get().launcher
    return max(int(launcher.get("gpus_per_node") or 0), int(launcher.get("gpus_per_task") or 0))


def check_gpus_seen(asked: int) -> None:
    """A job given GPUs that jax does not see would train on the CPU: refused at its start,
    with what to install."""
    import jax

    if asked and jax.default_backend() != "gpu":
        raise ConfigError("hydra.launcher.gpus_per_node", asked, (
            f"the job was given GPUs but jax sees only {jax.default_backend()} devices: "
            "install jax's CUDA plugin into the venv the job runs (make install-gpu), or "
            "ask for none"))


def objective(key: str | None, result: dict[str, Any]) -> dict[str, Any] | float:
    """What the job returns to its sweeper: the summary, or, for a sweeper that optimises
    `logging.objective`, that value (NaN for a job that failed or lacks the key, which
    Optuna and the like record as a failed trial)."""
    if key is None:
        return result
    value = result.get(key)
    if value is None and not {"failed", "refused"} & result.keys():
        have = ", ".join(k for k in result if isinstance(result[k], float)) or "none"
        print(f"logging.objective={key} is not in this run's summary; it has: {have}",
              file=sys.stderr)
    return float(value) if isinstance(value, (int, float)) else math.nan


def run_job(dict_cfg: DictConfig) -> dict[str, Any]:
    """One job, start to end: its checks, wandb and progress around `decompose`, and each way
    it can end said in one line (an exit code, or a sweep's row)."""
    # Before JAX starts its backend: the GPU allocator gets the memory the gate caps at, and
    # a CPU program's temporaries come from the calling thread's reusable heap.
    from pdecomp.core.hardware import export_job_memory
    export_job_memory(float(dict_cfg.memory.safety_fraction))
    host.run_programs_inline()
    job = start_job(dict_cfg)
    from pdecomp.run.decompose import (  # jax only once the job's runtime is set up
        decompose,
        prepare,
    )

    try:  # checks that need the job's devices, before anything is written
        check_gpus_seen(gpus_asked())
        run = prepare(job.cfg, job.run_dir)
    except ConfigError as e:
        print(e, file=sys.stderr)
        if job.rank0 and not (job.multirun or job.in_slurm):
            _discard(job.run_dir)
        return job.ended(EXIT_BAD_CONFIG, str(e))
    wb = WandbLogger(job.cfg, job.run_dir, wandb_config(job), wandb_identity(job)) if (
        wandb_mode(job.cfg) != "disabled" and job.rank0) else None
    progress = ProgressView(job, wb)
    try:
        with progress.bar, (job.signals or contextlib.nullcontext()):
            summary = decompose(run, job.run_dir, progress.hooks())
    except Exception as e:  # noqa: BLE001 - each way a run ends, said by `ended_by`
        return ended_by(job, wb, e)
    if wb:
        for k, v in summary.items():
            wb.summary(k, v)
        if job.cfg.logging.wandb.artifacts and (last := last_checkpoint(job.run_dir)):
            wb.artifact("checkpoint", last, by_reference=True)
        wb.finish()
    if job.rank0 and "gate" not in summary:
        print_findings(job.cfg, summary, job.run_dir)
    return summary


class ProgressView:
    """The job's console: the gate's tables, a progress bar (a plain line every 5% of the
    steps or every minute in a log file), and the metrics to wandb."""

    def __init__(self, job: Job, wb: WandbLogger | None):
        self.job, self.wb = job, wb
        cfg = job.cfg
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                            TextColumn("{task.completed}/{task.total}"),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                            TimeRemainingColumn(), console=console,
                            disable=not (cfg.logging.progress and job.rank0) or cfg.gate.only)
        self.task = self.bar.add_task(cfg.name, total=cfg.optim.steps, info="")
        self.plain_lines = not self.bar.disable and not console.is_terminal
        self.last_line = time.monotonic()

    def hooks(self) -> Any:
        from pdecomp.run.decompose import Hooks

        job = self.job
        return Hooks(log=lambda s: console.print(f"[dim]{s}[/dim]") if job.rank0 else None,
                     on_metrics=(self.wb.log if self.wb else None), on_gate=self.on_gate,
                     progress=self.on_progress,
                     should_stop=job.signals.stop_requested if job.signals else None,
                     detach_gate=not (job.in_slurm or job.multirun),
                     on_target_loaded=host.keep_freed_blocks_on_cpu,
                     temporaries_reused=True,  # run_programs_inline, keep_freed_blocks
                     quiet_checkpoint_failures=True)

    def on_gate(self, report: GateReport) -> None:
        if self.job.rank0:
            console.print(gate_table(report))
            if temps := temps_table(report):
                console.print(temps)
        if self.wb:
            self.wb.summary("gate", report.to_json())
            self.wb.log(0, {"hbm/predicted_peak_gib": report.peak_bytes / GiB})

    def on_progress(self, done: int, total: int, last: dict[str, float]) -> None:
        info = f"loss {last['loss/total']:.3g}" if "loss/total" in last else ""
        self.bar.update(self.task, completed=done, info=info)
        now = time.monotonic()
        if self.plain_lines and (done == total or done % max(total // 20, 1) == 0
                                 or now - self.last_line >= 60):
            self.last_line = now
            rate = f", {1 / last['perf/step_s']:.3g} steps/s" if "perf/step_s" in last else ""
            console.print(f"{self.job.cfg.name}: step {done}/{total}"
                          f"{', ' + info if info else ''}{rate}", highlight=False)


def ended_by(job: Job, wb: WandbLogger | None, e: Exception) -> dict[str, Any]:
    """How a run that raised ends: a refusal, a full disk, a scheduler's stop, a non-finite
    loss, or any other fault (re-raised, except in an in-process sweep, which goes on)."""
    from pdecomp.run.decompose import GateRefused, Interrupted, NonFiniteLoss

    if isinstance(e, GateRefused):
        if job.rank0:
            console.print(f"[red]{e}[/red]  (report: {job.run_dir / 'gate.json'})")
        if wb:
            wb.finish(exit_code=EXIT_GATE_REFUSED)
        if job.in_slurm:  # every rank exits 3; the launcher reports the job
            cluster.say(job.ranks, f"gate refused: exit {EXIT_GATE_REFUSED}")
        return {**job.ended(EXIT_GATE_REFUSED, str(e)), "refused": True, "gate": e.report.to_json()}
    if isinstance(e, WriteFailed):  # a full disk: the last complete checkpoint is intact
        again = (f"hydra.sweep.dir={job.sweep_dir}" if job.multirun
                 else f"hydra.run.dir={job.run_dir}")
        line = f"{e}; resume with {again}"
        if job.in_sweep:  # the sweep's other jobs still run (and may fit)
            print(line, file=sys.stderr)
            return job.ended(EXIT_FAULT, line)
        cluster.leave(job.ranks, line, EXIT_FAULT)
    if isinstance(e, Interrupted):
        interrupted(job, wb, e)
    if wb:
        wb.finish(exit_code=EXIT_FAULT)
    if isinstance(e, NonFiniteLoss):  # a fault the run explains in full: no traceback
        print(f"error: {e}", file=sys.stderr)
        return job.ended(EXIT_FAULT, f"error: {e}")
    if not job.in_sweep:
        raise e
    traceback.print_exception(e)
    return job.ended(EXIT_FAULT, f"{type(e).__name__}: {e}")


def interrupted(job: Job, wb: WandbLogger | None, e: Exception) -> None:
    """Stopped by a signal at a checkpoint: requeued (SLURM) or told how to resume."""
    signals = job.signals
    assert signals is not None
    code = EXIT_REQUEUED if signals.requeue_requested() else signals.exit_code()
    if wb:
        wb.finish(exit_code=code)
    if job.in_slurm:
        max_requeues = HydraConfig.get().launcher.get("max_num_timeout", 0)
        _stop_for_scheduler(job.ranks, signals, e, max_requeues)
    console.print(f"{', '.join(dict.fromkeys(signals.received))}: {e}; resume with "
                  f"`pdecomp resume {job.run_dir}`; exit {code}",
                  markup=False, highlight=False)
    sys.exit(code)


def _stop_for_scheduler(ranks: cluster.Ranks, signals: cluster.StopSignals, e: Exception,
                        max_requeues: int) -> None:
    """Every rank has checkpointed at the same step; requeue (rank 0) and leave without a
    result, so that submitit waits for the requeued job instead of reporting this one."""
    from pdecomp.core import processes as hosts

    why = ", ".join(dict.fromkeys(signals.received))
    if signals.requeue_requested():
        if ranks.process_id == 0:
            cluster.say(ranks, f"{why}: {e}; {cluster.requeue(max_requeues)}")
        hosts.barrier("pdecomp: requeued")  # no rank leaves before the requeue is on record
        cluster.say(ranks, f"exit {EXIT_REQUEUED}")
        sys.exit(EXIT_REQUEUED)
    cluster.say(ranks, f"{why}: {e}; exit {signals.exit_code()}")
    sys.exit(signals.exit_code())

"""One job: run directory, wandb, progress and reports around `pdecomp.run.decompose`."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from launcher import cluster, outcome
from launcher.console import make_console
from launcher.registry import to_run_config
from pdecomp.config import EXIT_BAD_CONFIG, EXIT_GATE_REFUSED, ConfigError, RunConfig
from pdecomp.storage import EXIT_WRITE_FAILED, WriteFailed
from pdecomp.units import GiB, fmt_bytes

console = make_console(stderr=True)


def gate_table(report: dict[str, Any], title: str = "memory gate (per device)") -> Table:
    from pdecomp.gate import format_report

    table = Table(title=title, show_header=False)
    for label, value in format_report(report):
        table.add_row(label, value)
    return table


def temps_table(report: dict[str, Any]) -> Table | None:
    """What to cut: the largest temporaries, with the operation and source line behind each."""
    if not report.get("largest_temps"):
        return None
    table = Table(title="largest temporaries (XLA buffer assignment)")
    for col in ("size", "shape", "operation", "source"):
        table.add_column(col, overflow="fold")
    for t in report["largest_temps"]:
        table.add_row(fmt_bytes(t["bytes"]), t["shape"], t["op"], t["source"])
    return table


class WandbLogger:
    """Offline by default; every file stays inside the run directory; resumes its own run."""

    def __init__(self, cfg: RunConfig, run_dir: Path, config: dict[str, Any]):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            os.environ.setdefault(var, str(run_dir))
        os.environ.setdefault("WANDB_SILENT", "true")
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self.run = wandb.init(project=cfg.logging.wandb_project, name=cfg.name, id=run_id,
                              resume="allow", dir=str(run_dir), config=config,
                              settings=wandb.Settings(console="off", x_disable_stats=True))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def summary(self, key: str, value: Any) -> None:
        self.run.summary[key] = value

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def log_report(run: Any, index: Path) -> None:
    """After `pdecomp analyze` on a run that logs to wandb: the report's plots, as images,
    in that run's wandb (resumed by its id; offline unless WANDB_MODE says otherwise)."""
    if not run.config.logging.wandb:
        return
    import wandb
    import yaml

    config = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    wb = WandbLogger(run.config, run.run_dir, config)
    wb.run.log({f"analyze/{p.stem}": wandb.Image(str(p))
                for p in sorted(index.parent.glob("*.png"))})
    wb.finish()


def _discard(run_dir: Path) -> None:
    """Remove a run directory that holds only what Hydra wrote for a job that never ran."""
    hydra_only = all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir())
    if hydra_only:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_job(dict_cfg: DictConfig) -> dict[str, Any]:
    # Before JAX starts its backend: the GPU allocator gets the memory the gate caps at, and
    # a CPU program's temporaries come from the calling thread's reusable heap.
    from pdecomp.hardware import export_job_memory, run_host_programs_inline
    export_job_memory(float(dict_cfg.memory.safety_fraction))
    run_host_programs_inline()
    # In a SLURM job every task runs this; they become one JAX runtime before JAX starts.
    in_slurm = cluster.in_slurm_job()
    ranks = cluster.job_ranks()

    from pdecomp.run import GateRefused, Hooks, Interrupted, NonFiniteLoss, decompose, preflight

    # orbax (through absl) and jax log routine events at INFO; keep the console for results.
    for name in ("absl", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)

    resolved = OmegaConf.to_container(dict_cfg, resolve=True, enum_to_str=True)
    cfg = to_run_config(resolved)
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    rank0 = ranks.process_id == 0

    def ended(code: int, reason: str) -> dict[str, Any]:
        """A job that did not finish: a sweep's row says how (every job of an in-process
        sweep runs whatever the others do); a single run exits with the code."""
        if rank0 and (multirun or in_slurm):
            with contextlib.suppress(WriteFailed):  # a full disk: the launcher says "failed"
                outcome.write(run_dir, code, reason)
        if multirun and not in_slurm:
            return {"failed": True, "exit_code": code, "reason": reason}
        sys.exit(code)

    # A scheduler's signal (SLURM), or SIGTERM / Ctrl-C (anywhere else), stops training at
    # the next step boundary with a checkpoint; the run resumes from it.
    signals = None if cfg.gate.only and not in_slurm else cluster.StopSignals(in_slurm)
    if in_slurm:
        assert signals is not None
        signals.install()  # from the start: SLURM's signals would otherwise end the task
        cluster.init_distributed(ranks, cfg.mesh.init_timeout_s)
        cluster.say(ranks, f"job {os.environ['SLURM_JOB_ID']} on {os.uname().nodename}, "
                           f"node {ranks.node}/{ranks.num_nodes}")
    try:  # checks that need the job's devices, before anything is written
        preflight(cfg, run_dir)
    except ConfigError as e:
        print(e, file=sys.stderr)
        if rank0 and not (multirun or in_slurm):
            _discard(run_dir)
        return ended(EXIT_BAD_CONFIG, str(e))

    wb = WandbLogger(cfg, run_dir, resolved) if (cfg.logging.wandb and rank0) else None
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                        disable=not (cfg.logging.progress and rank0) or cfg.gate.only)
    task = progress.add_task(cfg.name, total=cfg.optim.steps, info="")

    def on_gate(report: dict[str, Any]) -> None:
        if rank0:
            console.print(gate_table(report))
            if temps := temps_table(report):
                console.print(temps)
        if wb:
            wb.summary("gate", report)
            wb.log(0, {"hbm/predicted_peak_gib": report["peak_bytes"] / GiB})

    # A log file (SLURM, nohup) gets no live bar: it gets a plain line every 5% of the steps
    # or every minute, whichever comes first.
    plain_lines = not progress.disable and not console.is_terminal
    last_line = time.monotonic()

    def on_progress(done: int, total: int, last: dict[str, float]) -> None:
        nonlocal last_line
        info = f"loss {last['loss/total']:.3g}" if "loss/total" in last else ""
        progress.update(task, completed=done, info=info)
        now = time.monotonic()
        if plain_lines and (done == total or done % max(total // 20, 1) == 0
                            or now - last_line >= 60):
            last_line = now
            rate = f", {1 / last['perf/step_s']:.3g} steps/s" if "perf/step_s" in last else ""
            console.print(f"{cfg.name}: step {done}/{total}{', ' + info if info else ''}{rate}",
                          highlight=False)

    hooks = Hooks(log=lambda s: console.print(f"[dim]{s}[/dim]") if rank0 else None,
                  on_metrics=(wb.log if wb else None), on_gate=on_gate, progress=on_progress,
                  should_stop=signals.stop_requested if signals else None,
                  detach_gate=not (in_slurm or multirun), keep_freed_host_memory=True,
                  quiet_checkpoint_failures=True)
    try:
        with progress, (signals or contextlib.nullcontext()):
            summary = decompose(cfg, run_dir, hooks)
    except GateRefused as e:
        if rank0:
            console.print(f"[red]{e}[/red]  (report: {run_dir / 'gate.json'})")
        if wb:
            wb.finish(exit_code=EXIT_GATE_REFUSED)
        if in_slurm:  # every rank exits 3; the launcher reports the job
            cluster.say(ranks, f"gate refused: exit {EXIT_GATE_REFUSED}")
        return {**ended(EXIT_GATE_REFUSED, str(e)), "refused": True, "gate": e.report}
    except WriteFailed as e:  # a full disk: the last complete checkpoint is intact
        again = f"hydra.sweep.dir={hc.sweep.dir}" if multirun else f"hydra.run.dir={run_dir}"
        line = f"{e}; resume with {again}"
        if multirun and not in_slurm:  # the sweep's other jobs still run (and may fit)
            print(line, file=sys.stderr)
            return ended(EXIT_WRITE_FAILED, line)
        cluster.leave(ranks, line, EXIT_WRITE_FAILED)
    except Interrupted as e:
        assert signals is not None
        code = cluster.EXIT_REQUEUED if signals.requeue_requested() else signals.exit_code()
        if wb:
            wb.finish(exit_code=code)
        if in_slurm:
            _stop_for_scheduler(ranks, signals, e, hc.launcher.get("max_num_timeout", 0))
        console.print(f"{', '.join(dict.fromkeys(signals.received))}: {e}; resume with "
                      f"`pdecomp hydra.run.dir={run_dir}` and the same overrides; exit {code}",
                      markup=False, highlight=False)
        sys.exit(code)
    except NonFiniteLoss as e:  # a fault the run explains in full: one line, no traceback
        if wb:
            wb.finish(exit_code=1)
        print(f"error: {e}", file=sys.stderr)
        return ended(1, f"error: {e}")
    except Exception as e:  # a job of an in-process sweep: the sweep goes on
        if not (multirun and not in_slurm):
            raise
        traceback.print_exc()
        if wb:
            wb.finish(exit_code=1)
        return ended(1, f"{type(e).__name__}: {e}")
    if wb:
        for k, v in summary.items():
            wb.summary(k, v)
        wb.finish()
    if rank0 and "gate" not in summary:
        print_findings(cfg, summary, run_dir)
    return summary


def _stop_for_scheduler(ranks: cluster.Ranks, signals: cluster.StopSignals, e: Exception,
                        max_requeues: int) -> None:
    """Every rank has checkpointed at the same step; requeue (rank 0) and leave without a
    result, so that submitit waits for the requeued job instead of reporting this one."""
    from pdecomp import hosts

    why = ", ".join(dict.fromkeys(signals.received))
    if signals.requeue_requested():
        if ranks.process_id == 0:
            cluster.say(ranks, f"{why}: {e}; {cluster.requeue(max_requeues)}")
        hosts.barrier("pdecomp: requeued")  # no rank leaves before the requeue is on record
        cluster.say(ranks, f"exit {cluster.EXIT_REQUEUED}")
        sys.exit(cluster.EXIT_REQUEUED)
    cluster.say(ranks, f"{why}: {e}; exit {signals.exit_code()}")
    sys.exit(signals.exit_code())


# Per-site metrics the findings table shows where the summary has them: (column, summary
# key, format).
FINDINGS_COLUMNS = (("1-hot live", "live_one_hot", "d"), ("MMCS", "mmcs", ".3f"),
                    ("ML2R", "ml2r", ".3f"), ("one-to-one", "one_to_one", "d"))


def print_findings(cfg: RunConfig, summary: dict[str, Any], run_dir: Path) -> None:
    """What the decomposition found, in a form a person reads at a glance."""
    from pdecomp.kinds import site_C
    from pdecomp.metrics import EVAL_KINDS

    table = Table(title=f"{cfg.name}: what SPD found")
    sites = site_C(cfg.model, cfg.layers)
    # the kind's per-site metrics: those the summary has for some site
    extra = [(col, key, spec) for col, key, spec in FINDINGS_COLUMNS
             if any(f"{key}/{s}" in summary for s in sites)]
    # site names whole, never cut to "layers.0.mlp_…" on a narrow console
    table.add_column("site", no_wrap=True, min_width=max(map(len, sites)))
    for col in ("C", "live", "L0", *(col for col, _, _ in extra)):
        table.add_column(col)
    for site, C in sites.items():
        def fmt(key: str, spec: str = ".3f", site: str = site) -> str:
            v = summary.get(f"{key}/{site}")
            return "-" if v is None else format(v, spec)

        table.add_row(site, str(C), fmt("live", "d"), fmt("l0"),
                      *(fmt(key, spec) for _, key, spec in extra))
    console.print(table)
    if "ce/target" in summary:  # an LM: how much of the target's behaviour each mask keeps
        masks = Table(title=f"every site masked; target CE {summary['ce/target']:.4f}")
        for col in ("mask", "CE", "KL to target", "CE unrecovered"):
            masks.add_column(col)
        for kind in EVAL_KINDS:
            if f"ce/{kind}" not in summary:  # pgd: loss.eval_pgd.n_steps=0
                continue
            unrecovered = summary[f"ce_unrecovered/{kind}"]
            masks.add_row(kind, f"{summary[f'ce/{kind}']:.4f}", f"{summary[f'kl/{kind}']:.4f}",
                          "n/a (zero-ablation CE ≤ target's)" if unrecovered is None
                          else f"{unrecovered:.3f}")
        console.print(masks)
    for key in ("plots/tms_directions", "plots/mean_ci"):
        if key in summary:
            console.print(f"plot: {summary[key]}")
    console.print(f"run dir: {run_dir}")

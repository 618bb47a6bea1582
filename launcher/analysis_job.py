"""`pdecomp analyze RUN_DIR [flags] cluster=<preset> [hydra.launcher.KEY=VALUE ...]`: the
analysis as a job of the launcher a run would use (docs/analyze.md).

`cluster=slurm` (or `slurm_b200x64`, or a preset of the user's) submits the analysis as one
SLURM job running the copy of the code taken at submission, and returns with the job's id,
its log and where the report will be; `--wait` holds the terminal until it has ended and
exits with its code. `cluster=local` runs it as a local submitit job; `cluster=basic` in
this process, as without the overrides. The arguments and the launcher keys are checked
here first: a bad one is one line and exit 2, before anything is submitted or written.

An analysis is one process: it drives every device its node gives it (`--devices N`, N up
to the node's GPUs); a job of several tasks or nodes is refused.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from launcher import cluster, slurm_jobs, snapshot
from pdecomp.core.exits import EXIT_BAD_CONFIG

# The overrides that choose and set the launcher; every other argument is the analysis's.
LAUNCHER_KEYS = ("cluster=", "hydra.launcher.", "hydra/launcher=")
JOBS_DIR = ".analysis-jobs"  # in the run directory: submitit's files and the code's copy
_OWN_KEYS = ("wait", "snapshot", "_target_")  # pdecomp's launcher keys, not submitit's


def launcher_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the analysis's own arguments, the launcher's overrides) of `argv`."""
    def is_launcher(a: str) -> bool:
        return a.lstrip("+~").startswith(LAUNCHER_KEYS)

    return [a for a in argv if not is_launcher(a)], [a for a in argv if is_launcher(a)]


def one_process(params: dict[str, Any]) -> str | None:
    """Why a launcher's job shape cannot run an analysis (one process), or None."""
    nodes, tasks = params.get("nodes") or 1, params.get("tasks_per_node") or 1
    if nodes * tasks == 1:
        return None
    key = "nodes" if nodes > 1 else "tasks_per_node"
    return (f"hydra.launcher.{key}={params[key]}: an analysis runs as one process, which "
            "drives every device of its node (--devices N): give nodes=1 tasks_per_node=1")


def run_analysis(argv: list[str], gpus: int) -> int:
    """In the job: the analysis, as `pdecomp analyze argv` runs it on this machine."""
    from launcher.commands.analyze import main
    from launcher.job import check_gpus_seen
    from launcher.wandb_run import log_report
    from pdecomp.core.config import ConfigError

    cluster.split_cpu_devices()
    print(f"analysis on {os.uname().nodename}, code {snapshot.code_root()}", file=sys.stderr,
          flush=True)
    try:
        check_gpus_seen(gpus)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return EXIT_BAD_CONFIG
    return main(argv, on_report=log_report)


def submit(argv: list[str], run_dir: Path, kind: str, params: dict[str, Any]) -> Any:
    """The analysis submitted as one job of `kind`; submitit's handle on it."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    jobs_dir = run_dir / JOBS_DIR
    keys = {k: v for k, v in params.items() if k not in _OWN_KEYS}
    keys["submitit_folder"] = str(jobs_dir / "%j")
    if kind == "slurm":
        keys["name"] = keys.get("name") or f"pdecomp-analyze-{run_dir.name}"
        if params.get("snapshot", True):
            code = snapshot.take(jobs_dir / ".code" / stamp)
            keys["setup"] = [snapshot.setup_line(code), *(keys.get("setup") or [])]
    gpus = int(params.get("gpus_per_node") or 0)
    job = slurm_jobs.executor(keys, kind).submit(run_analysis, argv, gpus)
    with contextlib.suppress(OSError):  # submitit's folder template, made and left empty
        (jobs_dir / "%j").rmdir()
    return job


def say_submitted(job: Any, run_dir: Path, kind: str) -> None:
    slurm = kind == "slurm"
    follow = f"squeue -j {job.job_id}    " if slurm else ""
    lines = [f"submitted the analysis of {run_dir} as {kind} job {job.job_id}",
             f"follow:  {follow}tail -f {job.paths.stderr}",
             (f"report:  {run_dir / 'analysis' / 'index.html'} once it has ended (--wait: "
             "hold the terminal until then)")]
    if slurm:
        lines.append(f"cancel:  scancel {job.job_id}")
    print("\n".join(lines), flush=True)


def main(own: list[str], kind: str, params: dict[str, Any], wait: bool) -> int:
    """`pdecomp analyze own` on the launcher `kind` (`basic`: here) with `params`, its
    `hydra.launcher` keys; checked, then run or submitted."""
    from launcher.commands import analyze
    from launcher.wandb_run import log_report

    if kind == "basic":
        return analyze.main(own, on_report=log_report)
    args = analyze.parser().parse_args(own)
    if bad := analyze.refusal(args):
        print(bad, file=sys.stderr)
        return EXIT_BAD_CONFIG
    why = one_process(params) or (args.target != "local" and (
        f"--target={args.target} gates from this host and is not submitted: leave out "
        "the launcher's overrides"))
    if why:
        print(f"config error: {why}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    run_dir = Path(args.run_dir).absolute()  # the job may start elsewhere
    job = submit([str(run_dir) if a == args.run_dir else a for a in own], run_dir, kind, params)
    say_submitted(job, run_dir, kind)
    return wait_for(job) if wait else 0


def wait_for(job: Any) -> int:
    """The job's exit code, once it has ended (1 for one that ended without one)."""
    try:
        code = int(job.result())
    except Exception as e:  # noqa: BLE001 - submitit's: the job failed, was cancelled, ...
        print(f"analysis job {job.job_id} ended without a result ({type(e).__name__}); "
              f"log: {job.paths.stderr}", file=sys.stderr)
        return 1
    print(f"analysis job {job.job_id} ended: exit {code}", flush=True)
    return code

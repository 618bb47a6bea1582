"""The jobs a `cluster=slurm` submission left in the queue: what was submitted (`jobs.json` in
the sweep directory: job ids, directories, logs, the commit and code they run), how to
follow them, and how each one ended once it has.

`pdecomp cluster=slurm ...` submits and returns; `pdecomp status <sweep dir>` (launcher.status)
later builds the same summary the blocking `--wait` prints, from what the jobs wrote and what
SLURM says of those that wrote nothing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from rich.console import Console

from launcher import outcome
from pdecomp.core.exits import EXIT_GATE_REFUSED
from pdecomp.core.storage import read_json, write_text

FILE = "jobs.json"
# SLURM states of a job that has not ended (a requeued job is pending again).
UNSETTLED = ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING",
             "SUSPENDED", "READY", "UNKNOWN", "PREEMPTED", "REQUEUE_HOLD", "REQUEUE_FED")


def executor(params: dict[str, Any], kind: str = "slurm") -> Any:
    """submitit's executor for `hydra.launcher`'s keys (`submitit_folder` among them), as
    hydra-submitit-launcher makes it: its shared keys as they are, the others named for the
    executor (`slurm_...`)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    params = dict(params)
    init = {"slurm_max_num_timeout": params.pop("max_num_timeout")} if kind == "slurm" else {}
    made = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster=kind, **init)
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    if kind == "slurm":
        # One rank that fails ends the job's other ranks at once (they would otherwise wait
        # in a collective until a timeout).
        params["srun_args"] = ["--kill-on-bad-exit=1", *(params.get("srun_args") or [])]
    made.update_parameters(**{k if k in shared else f"{kind}_{k}": v
                              for k, v in params.items() if v is not None})
    return made


def write(sweep_dir: Path, submitted: dict[str, Any]) -> None:
    write_text(sweep_dir / FILE, json.dumps(submitted, indent=1))


def load(sweep_dir: Path) -> dict[str, Any] | None:
    f = sweep_dir / FILE
    return read_json(f)


def dirs(submitted: dict[str, Any]) -> dict[int, Path]:
    """Each job's directory by job number (made by the job when it starts)."""
    return {j["num"]: Path(j["dir"]) for j in submitted["jobs"]}


def job_ids(submitted: dict[str, Any]) -> list[str]:
    """The ids to give squeue/sacct/scancel: an array's own id once, else each job's."""
    ids = [j["job_id"].split("_")[0] for j in submitted["jobs"]]
    return list(dict.fromkeys(ids))


def say_submitted(sweep_dir: Path, submitted: dict[str, Any], console: Console) -> None:
    """What was submitted and how to follow it, one plain line each."""
    jobs = submitted["jobs"]
    ids = ",".join(job_ids(submitted))
    commit = submitted["provenance"].get("commit") or "unknown"
    code = submitted.get("code") or "the installed package"
    lines = [
        (f"submitted {len(jobs)} SLURM job(s) as {submitted['name']!r}: "
         f"{', '.join(j['job_id'] for j in jobs)} (commit {commit}; they run {code})"),
        f"follow:  squeue -j {ids}    tail -f {jobs[0]['stderr']}",
        f"results: pdecomp status {sweep_dir}    (--wait: until every job has ended)",
        f"cancel:  scancel {ids}",
    ]
    for line in lines:
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def slurm_job(submitted: dict[str, Any], entry: dict[str, Any]) -> Any:
    """submitit's handle on one submitted job (its state, logs and result file)."""
    import submitit

    return submitit.SlurmJob(folder=submitted["submitit_folder"], job_id=entry["job_id"])


def settle(job: Any, job_dir: Path, state: str) -> tuple[Any, dict[str, Any] | None]:
    """An ended job (`state`: SLURM's last word on it): its result (rank 0's JobReturn) if
    it wrote one, else how it ended (the job's own outcome.json, or one written here from
    what SLURM or its traceback says)."""
    import submitit

    error = f"SLURM state {state}"
    # A job that ended without writing a result is not waited on further (submitit would
    # give a slow shared file system another 15 s to show the file).
    if state == "COMPLETED" or job.paths.result_pickle.exists():
        try:
            return job.results()[0], None
        except (submitit.core.utils.UncompletedJobError,
                submitit.core.utils.FailedJobError) as e:
            lines = [x.strip() for x in str(e).splitlines() if x.strip()]
            error = lines[-1] if lines else type(e).__name__  # a traceback's last line
    ended = outcome.read(job_dir)  # what rank 0 said before it left, if it did
    if ended is None:
        gate = job_dir / "gate.json"
        refused = gate.exists() and not (read_json(gate) or {}).get("fits", True)
        code, why = (EXIT_GATE_REFUSED, "gate refused") if refused else (1, error)
        job_dir.mkdir(parents=True, exist_ok=True)
        ended = outcome.write(job_dir, code, why)
    return None, ended


def states(submitted: dict[str, Any]) -> dict[int, tuple[Any, str]]:
    """Each job's handle and SLURM state, from one fresh sacct call for all of them; where
    sacct knows nothing (a cluster without accounting), squeue's word, or ENDED when the
    queue no longer holds the job."""
    handles = {e["num"]: slurm_job(submitted, e) for e in submitted["jobs"]}
    if handles:
        next(iter(handles.values())).watcher.update()  # one call, every registered job
    out = {}
    for num, job in handles.items():
        state = job.watcher.get_state(job.job_id, mode="cache").split()[0].upper()
        if state == "UNKNOWN":
            state = queued_state(job.job_id) or "ENDED"
        out[num] = job, state
    return out


def queued_state(job_id: str) -> str | None:
    """squeue's state of a job still in the queue, else None."""
    try:
        said = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                              text=True, timeout=60, check=False).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return said[0] if said else None


def unsettled(job: Any, state: str) -> bool:
    """Not ended yet: no result written and SLURM has it queued, running or requeued."""
    return state in UNSETTLED and not job.paths.result_pickle.exists()

"""`cluster=slurm` (`hydra/launcher=pdecomp_slurm`): hydra-submitit-launcher's SLURM launcher, with what its 1.2.0 lacks.

- `srun_args` and a `tasks_per_node` that may be left to SLURM (null);
- rank 0 alone keeps Hydra's job files and log: every rank runs the whole task function in
  the same job directory;
- it submits and returns (`hydra.launcher.wait=false`, the default): the jobs, how to
  follow them and `pdecomp status <sweep dir>` are printed, and recorded in `jobs.json`
  (launcher.slurm_jobs); `pdecomp --wait ...` (`wait=true`) holds the terminal to the end,
  as does any sweeper that needs each job's result to choose the next (Optuna's);
- the jobs run a snapshot of the code and configs taken at submission (`snapshot=true`), so
  a checkout that changes while they wait in the queue does not change what they run;
- jobs are named after the preset (`hydra.launcher.name` to choose);
- a job that ends without a result (gate refused, crashed, cancelled) is reported in one line
  with its log file and its gate report, instead of a submitit traceback, and the sweep goes
  on to its summary (launcher.outcome); `pdecomp` then exits with the sweep's worst code.

Preemption and time limits are handled inside the job (launcher.job, launcher.cluster):
every rank checkpoints at one agreed step and the job requeues itself.
"""

# No `from __future__ import annotations`: Hydra's plugin scan (any Hydra app in the same
# environment) executes this module before it is in sys.modules, and a dataclass with
# string annotations then fails to build (dataclasses looks its module up there).
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import DictConfig, OmegaConf, open_dict

from launcher import cluster, slurm_jobs, snapshot
from pdecomp.core.exits import EXIT_GATE_REFUSED

log = logging.getLogger(__name__)

# Rank > 0: Hydra logs to stderr only (that rank's own SLURM log), never to the job's file.
_CONSOLE_LOGGING = {
    "version": 1,
    "formatters": {"simple": {"format": "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "simple",
                             "stream": "ext://sys.stderr"}},
    "root": {"level": "INFO", "handlers": ["console"]},
    "disable_existing_loggers": False,
}


@dataclass
class PdecompSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.pdecomp_launcher.slurm_launcher.SlurmLauncher"
    tasks_per_node: int | None = 1  # null: SLURM decides from the other resources
    srun_args: list[str] | None = None  # added to the `srun` line that starts every task
    # Requeues after a preemption or time limit before the job gives up (submitit's name).
    max_num_timeout: int = 3
    name: str | None = None  # the job's name in squeue; null: pdecomp-<preset or model>
    wait: bool = False  # hold the terminal until every job has ended (`pdecomp --wait`)
    snapshot: bool = True  # the jobs run a copy of the code taken at submission


ConfigStore.instance().store(group="hydra/launcher", name="pdecomp_slurm",
                             node=PdecompSlurmConf, provider="pdecomp")


class SlurmLauncher(BaseSubmititLauncher):
    _EXECUTOR = "slurm"

    # -- in the job, on every rank ---------------------------------------------------------
    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int,
                 job_id: str, singleton_state: dict[type, Singleton]) -> JobReturn:
        import submitit

        assert self.hydra_context is not None and self.config is not None
        assert self.task_function is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        env = submitit.JobEnvironment()
        snapshot.use_configs(self.hydra_context.config_loader)
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config,
                                                                          sweep_overrides)
        with open_dict(sweep_config.hydra):
            sweep_config.hydra.job.id = env.job_id
            sweep_config.hydra.job.num = job_num
            if env.global_rank != 0:
                sweep_config.hydra.output_subdir = None
                sweep_config.hydra.job_logging = _CONSOLE_LOGGING
        ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                      config=sweep_config, job_dir_key=job_dir_key,
                      job_subdir_key="hydra.sweep.subdir")
        if ret.status == JobStatus.FAILED:
            # Hydra keeps a task's exception in its JobReturn. Of several ranks, the failing
            # one leaves at once: a normal exit would first wait (minutes) in jax.distributed's
            # shutdown barrier for ranks that are still working; srun's --kill-on-bad-exit
            # then ends those.
            if env.num_tasks > 1:
                traceback.print_exception(ret._return_value, file=sys.stderr)
                cluster.say(cluster.job_ranks(), "failed: exit 1")
                sys.stdout.flush()
                os._exit(1)
            raise ret._return_value
        return ret

    # -- where `pdecomp` was started ---------------------------------------------------------
    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        from pdecomp.plan.resolve import provenance  # jax: not at Hydra's plugin scan

        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        params = dict(self.params)
        waits = bool(params.pop("wait")) or not str(
            self.config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper")
        # One copy per submission: jobs of an earlier one may still be running from theirs.
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        code = snapshot.take(sweep_dir / ".code" / stamp) if params.pop("snapshot") else None
        if code is not None:
            params["setup"] = [snapshot.setup_line(code), *(params.get("setup") or [])]
        params["name"] = params.get("name") or job_name(self.config)
        nums = [initial_job_idx + i for i in range(len(job_overrides))]
        for num, overrides in zip(nums, job_overrides):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        args = [(list(o), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
                for num, o in zip(nums, job_overrides)]
        folder = params["submitit_folder"]
        jobs = slurm_jobs.executor(params).map_array(self, *zip(*args))
        entries = [{"num": num, "job_id": job.job_id, "dir": str(self._job_dir(num, o)),
                    "overrides": filter_overrides(o), "stderr": str(job.paths.stderr)}
                   for job, num, o in zip(jobs, nums, job_overrides)]
        slurm_jobs.write(sweep_dir, {
            "submitted": datetime.now().isoformat(timespec="seconds"), "waited": waits,
            "name": params["name"], "submitit_folder": str(folder), "provenance": provenance(),
            "code": str(code) if code else None, "jobs": entries})
        if not waits:  # the sweep's end (launcher.callbacks) says how to follow them
            return [JobReturn(overrides=list(o), cfg=DictConfig({}), hydra_cfg=self.config,
                              working_dir=e["dir"], task_name=str(self.config.hydra.job.name),
                              status=JobStatus.COMPLETED, _return_value={"submitted": e["job_id"]})
                    for e, o in zip(entries, job_overrides)]
        tasks = params.get("nodes", 1) * (params.get("tasks_per_node") or 1)
        log.info(f"submitted {len(jobs)} SLURM job(s) ({', '.join(j.job_id for j in jobs)}), "
                 f"{tasks} task(s) each; logs: {jobs[0].paths.folder}; waiting for them")
        return [self._result(job, num, list(o), Path(e["dir"]))
                for job, num, o, e in zip(jobs, nums, job_overrides, entries)]

    def _job_dir(self, num: int, overrides: Sequence[str]) -> Path:
        """Where job `num` writes: the sweep's `hydra.sweep.subdir` for it, as the job will
        resolve it (composed here only when it depends on more than the job's number)."""
        assert self.config is not None and self.hydra_context is not None
        sweep = self.config.hydra.sweep
        subdir = OmegaConf.to_container(sweep, resolve=False)["subdir"]
        if subdir != "${hydra.job.num}":
            config = self.hydra_context.config_loader.load_sweep_config(self.config,
                                                                        list(overrides))
            with open_dict(config.hydra):
                config.hydra.job.num = num
            subdir = OmegaConf.select(config, "hydra.sweep.subdir")
        else:
            subdir = str(num)
        return Path(str(sweep.dir)).absolute() / str(subdir)

    def _result(self, job: Any, num: int, overrides: list[str], job_dir: Path) -> JobReturn:
        """Rank 0's JobReturn; for a job that produced none, a stand-in that says why."""
        job.wait()  # a result file, or SLURM says the job ended
        result, ended = slurm_jobs.settle(job, job_dir, job.state.split()[0].upper())
        if ended is None:
            return result
        code = ended["exit_code"]
        if code == EXIT_GATE_REFUSED:
            gate = job_dir / "gate.json"
            value = {"refused": True,
                     "gate": json.loads(gate.read_text()) if gate.exists() else None}
            log.error(f"job #{num} ({job.job_id}): gate refused, exit {code} on every rank; "
                      f"report: {gate}")
        else:
            value = {"failed": True, "error": ended["reason"]}
            log.error(f"job #{num} ({job.job_id}) ended without a result (exit {code}): "
                      f"{ended['reason']}; log: {job.paths.stderr}")
        return JobReturn(overrides=overrides, cfg=DictConfig({}), hydra_cfg=self.config,
                         working_dir=str(job_dir), task_name=str(self.config.hydra.job.name),
                         status=JobStatus.COMPLETED, _return_value=value)


def job_name(config: DictConfig) -> str:
    """The jobs' name in squeue: pdecomp-<the preset>, or the run's name without one."""
    preset = config.hydra.runtime.choices.get("experiment")
    return f"pdecomp-{preset or config.get('name', 'run')}"

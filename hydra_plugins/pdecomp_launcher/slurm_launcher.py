"""`cluster=slurm` (`hydra/launcher=pdecomp_slurm`): hydra-submitit-launcher's SLURM launcher, with what its 1.2.0 lacks.

- `srun_args` and a `tasks_per_node` that may be left to SLURM (null);
- rank 0 alone keeps Hydra's job files and log: every rank runs the whole task function in
  the same job directory;
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
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import DictConfig, OmegaConf, open_dict

from launcher import cluster, outcome
from pdecomp.exits import EXIT_GATE_REFUSED

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
        import submitit

        assert self.config is not None
        params = dict(self.params)
        executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                         slurm_max_num_timeout=params.pop("max_num_timeout"))
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        # One rank that fails ends the job's other ranks at once (they would otherwise wait
        # in a collective until a timeout).
        params["srun_args"] = ["--kill-on-bad-exit=1", *(params.get("srun_args") or [])]
        executor.update_parameters(**{k if k in shared else f"slurm_{k}": v
                                      for k, v in params.items() if v is not None})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)

        nums = [initial_job_idx + i for i in range(len(job_overrides))]
        for num, overrides in zip(nums, job_overrides):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
        args = [(list(o), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
                for num, o in zip(nums, job_overrides)]
        jobs = executor.map_array(self, *zip(*args))
        tasks = params.get("nodes", 1) * (params.get("tasks_per_node") or 1)
        log.info(f"submitted {len(jobs)} SLURM job(s) ({', '.join(j.job_id for j in jobs)}), "
                 f"{tasks} task(s) each; logs: {jobs[0].paths.folder}")
        return [self._result(job, num, list(o), sweep_dir)
                for job, num, o in zip(jobs, nums, job_overrides)]

    def _result(self, job: Any, num: int, overrides: list[str], sweep_dir: Path) -> JobReturn:
        """Rank 0's JobReturn; for a job that produced none, a stand-in that says why."""
        import submitit

        job.wait()  # a result file, or SLURM says the job ended
        state = job.state.split()[0].upper()  # e.g. "CANCELLED by 0"
        error = f"SLURM state {state}"
        # A job that ended without writing a result is not waited on further (submitit would
        # give a slow shared file system another 15 s to show the file).
        if state == "COMPLETED" or job.paths.result_pickle.exists():
            try:
                return job.results()[0]
            except (submitit.core.utils.UncompletedJobError,
                    submitit.core.utils.FailedJobError) as e:
                lines = [x.strip() for x in str(e).splitlines() if x.strip()]
                error = lines[-1] if lines else type(e).__name__  # a traceback's last line
        # The job directory follows hydra.sweep.subdir, which conf/config.yaml sets to the
        # job number.
        job_dir = sweep_dir / str(num)
        gate = job_dir / "gate.json"
        report = json.loads(gate.read_text()) if gate.exists() else None
        ended = outcome.read(job_dir)  # what rank 0 said before it left, if it did
        if ended is None:
            refused = report is not None and not report.get("fits", True)
            code, why = (EXIT_GATE_REFUSED, "gate refused") if refused else (1, error)
            job_dir.mkdir(parents=True, exist_ok=True)
            ended = outcome.write(job_dir, code, why)
        code = ended["exit_code"]
        if code == EXIT_GATE_REFUSED:
            value = {"refused": True, "gate": report}
            log.error(f"job #{num} ({job.job_id}): gate refused, exit {code} on every rank; "
                      f"report: {gate}")
        else:
            value = {"failed": True, "error": ended["reason"]}
            log.error(f"job #{num} ({job.job_id}) ended without a result (exit {code}): "
                      f"{ended['reason']}; log: {job.paths.stderr}")
        return JobReturn(overrides=overrides, cfg=DictConfig({}), hydra_cfg=self.config,
                         working_dir=str(job_dir), task_name=str(self.config.hydra.job.name),
                         status=JobStatus.COMPLETED, _return_value=value)

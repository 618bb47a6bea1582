"""`cluster=slurm` against a real SLURM cluster on this machine (scripts/slurm_cluster.sh):
two emulated nodes, accounting on. Jobs are real sbatch jobs whose tasks become one JAX run
over several processes (CPU devices, gloo collectives).

Where the cluster cannot be started (not root, no apt) these tests skip with the reason;
CI sets PDECOMP_REQUIRE_SLURM=1, which turns that skip into a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from conftest import PDECOMP, check_sweep_wandb, copy_of, load_json, ok, pdecomp
from jax.sharding import SingleDeviceSharding

# One journey (a run as a two-task SLURM job) is in `make test`; the rest in the slow tier.
pytestmark = pytest.mark.slurm

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "slurm_cluster.sh"

# TMS 5-2 for a few hundred steps: long enough to interrupt, short enough for CI.
STEPS = 600


def run_args(steps: int) -> list[str]:
    return [f"optim.steps={steps}", "logging.log_every=20", "logging.ckpt_every=200",
            "data.batch_size=256", "data.eval_batches=1", "logging.wandb.mode=disabled"]


RUN = run_args(STEPS)
TWO_TASKS = ["cluster=slurm", "hydra.launcher.tasks_per_node=2",
             "hydra.launcher.cpus_per_task=1"]
TWO_NODES = ["cluster=slurm", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1",
             "hydra.launcher.cpus_per_task=1"]


@pytest.fixture(scope="module")
def cluster(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    """The local cluster for this module, and the environment that reaches it."""
    why = None
    if os.geteuid() != 0:
        why = "the local SLURM cluster needs root"
    elif not any(Path(d, "apt-get").exists() for d in ("/usr/bin", "/bin")) and \
            not Path("/usr/sbin/slurmctld").exists():
        why = "no slurmctld and no apt-get to install it"
    if why:
        if os.environ.get("PDECOMP_REQUIRE_SLURM") == "1":
            pytest.fail(f"PDECOMP_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    # Ports of our own, away from a cluster someone may be running on the default ones.
    # (A cluster takes PORT_BASE .. PORT_BASE + 12.)
    cluster_env = {**env, "NODES": "2", "PORT_BASE": str(7000 + os.getpid() % 200 * 20)}
    start = subprocess.run(["bash", str(SCRIPT), "start", str(root)], env=cluster_env,
                           capture_output=True, text=True, timeout=600, check=False)
    assert start.returncode == 0, (start.stdout[-2000:], start.stderr[-2000:])
    yield {**env, "SLURM_CONF": str(root / "slurm.conf")}
    subprocess.run(["bash", str(SCRIPT), "stop", str(root)], capture_output=True, timeout=120,
                   check=False)


def one_process_run(run: list[str], env: dict[str, str], cwd: Path) -> Path:
    """`run` in one process with two CPU devices: what a two-process job must reproduce."""
    cwd.mkdir(exist_ok=True)
    ok(pdecomp([*run, f"hydra.run.dir={cwd / 'run'}"], cwd,
               {**env, "PDECOMP_CPU_DEVICES": "2"}, timeout=600))
    return cwd / "run"


@pytest.fixture(scope="module")
def reference(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RUN in one process (the toy target trains here, once)."""
    return one_process_run(RUN, env, tmp_path_factory.mktemp("reference"))


def submit(args: list[str], cwd: Path, env: dict[str, str],
           timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], Path, float]:
    """`pdecomp --wait cluster=slurm ...` to its end: the process, the sweep dir, seconds
    taken."""
    sweep = cwd / "sweep"
    t0 = time.perf_counter()
    proc = pdecomp(["--wait", *args, f"hydra.sweep.dir={sweep}"], cwd, env, timeout=timeout)
    return proc, sweep, time.perf_counter() - t0


def rank_logs(sweep: Path) -> dict[str, str]:
    """Every task's stderr (submitit's `<job>_<rank>_log.err`), by file name."""
    return {p.name: p.read_text() for p in sorted((sweep / ".submitit").glob("*/*_log.err"))}


def losses(run_dir: Path) -> dict[int, dict[str, float]]:
    return {h["step"]: {k: v for k, v in h.items() if k.startswith("loss/")}
            for h in load_json(run_dir / "history.json")}


def assert_same_losses(run_dir: Path, reference: Path, rel: float = 1e-5) -> None:
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == sorted(want)
    for step in want:
        for k, v in want[step].items():
            assert got[step][k] == pytest.approx(v, rel=rel, abs=1e-12), (step, k)


def final_state(run_dir: Path) -> dict[str, np.ndarray]:
    """The last checkpoint's arrays, read on this process's one device whatever mesh wrote
    them, keyed by their path in the TrainState."""
    ckpt = run_dir / "checkpoints" / str(STEPS) / "default"
    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(ckpt)
    meta = getattr(meta, "item_metadata", meta)
    one = SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
    restored = checkpointer.restore(ckpt, target)
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(restored)}


UNSETTLED = ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")


def sacct(job: str, env: dict[str, str], seconds: float = 60) -> list[list[str]]:
    """JobID, State, ExitCode of the job's records, once none is still unsettled: a job's
    results can be read (and `pdecomp` return) a moment before slurmctld records its end."""
    deadline = time.monotonic() + seconds
    while True:
        out = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,State,ExitCode"],
                             env=env, capture_output=True, text=True, check=True, timeout=60)
        rows = [line.split("|") for line in out.stdout.splitlines() if line]
        if not any(r[1].split()[0] in UNSETTLED for r in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(1)


def job_ids(sweep: Path) -> list[str]:
    return sorted(p.name for p in (sweep / ".submitit").iterdir() if p.is_dir())


# FSDP splits V, U and the CI function between the processes, so their reductions sum in
# another order than the 1-process run's. Over the 600 steps the losses drift apart by up to
# about 5e-4 relative (in one run: under 2e-7 to step 60, then a step where a CI value sat
# at a clamp edge moved the rest by 1e-4 to 5e-4, not growing after); a wrong gradient or
# a lost shard moves them by far more.
FSDP_REL = 2e-3


def check_two_process_run(proc, sweep: Path, reference: Path, hosts: int,
                          rel: float = 1e-4) -> None:
    ok(proc)
    run_dir = sweep / "0"
    gate = load_json(run_dir / "gate.json")
    assert gate["n_devices"] == 2 and "(2 hosts)" in gate["target"], gate["target"]
    assert_same_losses(run_dir, reference, rel=rel)  # f32 sums in another order across processes
    logs = rank_logs(sweep)
    assert len(logs) == 2, list(logs)
    for rank, text in enumerate(logs.values()):
        assert f"[rank {rank}/2]" in text
    nodes = {m for text in logs.values() for m in re.findall(r"node (\d)/(\d)", text)}
    assert nodes == ({("0", "1")} if hosts == 1 else {("0", "2"), ("1", "2")}), nodes
    # Rank 0 alone writes the run directory's log (every rank's submitit logs this line once).
    assert (run_dir / "pdecomp.log").read_text().count("Job completed successfully") == 1
    assert (run_dir / "summary.json").is_file() and (run_dir / ".hydra").is_dir()


# The journey `make test` keeps (the rest are the slow tier's), at a sixth of RUN's steps.
SHORT_STEPS = 100
SHORT_RUN = run_args(SHORT_STEPS)


def test_two_tasks_train_as_one_run(cluster, tmp_path: Path) -> None:
    """Two tasks on one node: two JAX processes, gate first, losses of the 1-process run."""
    reference = one_process_run(SHORT_RUN, cluster, tmp_path / "reference")
    proc, sweep, seconds = submit([*TWO_TASKS, *SHORT_RUN], tmp_path, cluster)
    print(f"2 tasks, {SHORT_STEPS} steps: {seconds:.1f} s")
    check_two_process_run(proc, sweep, reference, hosts=1)


FSDP_TWO_NODES = [*TWO_NODES, *RUN, "mesh.shard_state=true"]


@pytest.fixture(scope="module")
def fsdp_run(cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Two nodes, with the state split across them (FSDP): the sweep dir and the submitting
    process."""
    proc, sweep, seconds = submit(FSDP_TWO_NODES, tmp_path_factory.mktemp("fsdp"), cluster)
    print(f"2 nodes, {STEPS} steps: {seconds:.1f} s")
    return sweep, proc


@pytest.mark.slow
def test_two_emulated_nodes_train_as_one_run(fsdp_run, reference: Path) -> None:
    """The target, components and optimizer state each live half on one process, half on
    the other; the losses are the 1-process run's."""
    sweep, proc = fsdp_run
    check_two_process_run(proc, sweep, reference, hosts=2, rel=FSDP_REL)


@pytest.mark.slow
def test_interrupted_job_requeues_and_ends_as_if_uninterrupted(
        cluster, reference: Path, tmp_path: Path) -> None:
    """SLURM's warning signal mid-run: every rank checkpoints at one step, the job requeues
    itself, resumes there and ends with the final state of an uninterrupted run."""
    sweep = tmp_path / "sweep"
    t0 = time.perf_counter()
    runner = subprocess.Popen(
        [PDECOMP, "--wait", *TWO_TASKS, *RUN, f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
        env=cluster, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log0 = wait_for(lambda: next(iter(rank_logs(sweep).values()), ""),
                        lambda text: "[rank 0/2] job" in text, 240, runner)
        job = re.search(r"job (\d+) on", log0).group(1)
        # Signal mid-run: once the first cadence checkpoint (step 200) is complete.
        wait_for(lambda: (sweep / "0" / "checkpoints" / "200").is_dir(), bool, 240, runner)
        subprocess.run(["scancel", "--signal=USR2", job], env=cluster, check=True, timeout=60)
        log0 = wait_for(lambda: rank_logs(sweep).get(f"{job}_0_log.err", ""),
                        lambda text: "requeued job" in text, 120, runner)
        stopped_at = int(re.search(r"stopped at step (\d+)", log0).group(1))
        # SLURM holds a requeued job about two minutes before it may start again; a real
        # cluster waits them out, the test need not.
        wait_for(lambda: _pending(job, cluster), bool, 60, runner)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=cluster,
                       check=True, timeout=60)
        out, err = runner.communicate(timeout=600)
    finally:
        if runner.poll() is None:
            runner.kill()
    seconds = time.perf_counter() - t0
    print(f"interrupted at step {stopped_at}, resumed, finished: {seconds:.1f} s")
    ok(subprocess.CompletedProcess(runner.args, runner.returncode, out, err))
    assert 0 < stopped_at < STEPS
    logs = rank_logs(sweep)
    assert all(text.count("exit 75") == 1 for text in logs.values()), logs
    assert f"resumed from checkpoint at step {stopped_at}" in logs[f"{job}_0_log.err"]
    run_dir = sweep / "0"
    assert_same_losses(run_dir, reference)
    got, want = final_state(run_dir), final_state(reference)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.slow
def test_a_checkpoint_unreadable_on_one_process_is_set_aside_by_every_process(
        cluster, fsdp_run, reference: Path, tmp_path: Path) -> None:
    """FSDP over two nodes: each process reads only its own shards, so damaged chunks of one
    process's shards fail the read on that process alone. Both processes set the
    step aside together and resume from the one before it; none waits for the other in a
    barrier it never reaches."""
    run_dir = copy_of(fsdp_run, tmp_path / "sweep") / "0"
    # Overwrite the chunks of process 1's shards (index 1 on the split axis) with bytes
    # that are no chunk; process 0 never reads them.
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{run_dir}/checkpoints/{STEPS}/"
                                                      "default"}).result()
    shards_of_1 = [k for k in kv.list().result() if re.search(rb"/1(\.0)*$", k)]
    assert len(shards_of_1) > 10, shards_of_1
    for key in shards_of_1:
        kv.write(key, b"not a chunk").result()
    proc, sweep, seconds = submit(FSDP_TWO_NODES, tmp_path, cluster, timeout=420)
    print(f"resumed past a step damaged on process 1: {seconds:.1f} s")
    ok(proc)
    log0 = next(t for name, t in rank_logs(sweep).items() if name.endswith("_0_log.err")
                and "resumed from" in t)
    assert f"checkpoint at step {STEPS} cannot be read (on process 1)" in log0, log0[-3000:]
    assert f"resumed from checkpoint at step {STEPS - 200}" in log0, log0[-3000:]
    assert (run_dir / "checkpoints" / f"{STEPS}.unreadable").is_dir()
    assert_same_losses(run_dir, reference, rel=FSDP_REL)
    assert load_json(run_dir / "summary.json")["steps"] == STEPS


@pytest.mark.slow
def test_a_sweep_is_submitted_as_a_job_array_and_status_summarises_it(
        cluster, tmp_path: Path) -> None:
    """`pdecomp -m cluster=slurm ...` submits the sweep as one array and returns while its
    jobs wait (held here, so that they cannot have ended); `pdecomp status --wait` then
    prints the sweep's summary from what the jobs wrote. The jobs carry the preset's name
    and run the copy of the code taken at submission, whose commit their summaries record."""
    short = [o for o in RUN if not o.startswith("optim.steps=")] + ["optim.steps=100"]
    sweep = tmp_path / "sweep"
    proc = pdecomp(["-m", "cluster=slurm", *short, "logging.wandb.mode=offline",
                    "+hydra.launcher.additional_parameters.hold=true",
                    "loss.imp_min_coeff=0.001,0.003,0.01", f"hydra.sweep.dir={sweep}"],
                   tmp_path, cluster, timeout=120)
    ok(proc)
    submitted = load_json(sweep / "jobs.json")
    (array,) = {j["job_id"].split("_")[0] for j in submitted["jobs"]}
    assert [j["job_id"] for j in submitted["jobs"]] == [f"{array}_{i}" for i in range(3)]
    assert f"pdecomp status {sweep}" in proc.stdout and f"squeue -j {array}" in proc.stdout
    queued = subprocess.run(["squeue", "-h", "-r", "-j", array, "-o", "%T %j"], env=cluster,
                            capture_output=True, text=True, check=True, timeout=60).stdout
    assert queued.split() == ["PENDING", "pdecomp-tms_5-2"] * 3, queued
    waiting = pdecomp(["status", str(sweep)], tmp_path, cluster, timeout=120)
    ok(waiting)
    assert waiting.stdout.count("PENDING") == 3 and "3 of 3 jobs not ended yet" in waiting.stdout
    subprocess.run(["scontrol", "release", array], env=cluster, check=True, timeout=60)
    status = pdecomp(["status", str(sweep), "--wait", "--every", "1"], tmp_path, cluster,
                     timeout=600)
    ok(status)
    states = sacct(array, cluster)
    assert all(r[1] == "COMPLETED" for r in states if "." not in r[0]), states
    assert "sweep summary" in status.stdout and "PENDING" not in status.stdout
    for value in ("0.001", "0.003", "0.01"):
        assert value in status.stdout
    rows = load_json(sweep / "sweep_summary.json")
    assert len(rows) == 3 and all("summary.json" in r for r in rows)
    commit = submitted["provenance"]["commit"]
    assert all(r["summary.json"]["pdecomp/commit"] == commit for r in rows)
    assert all(f"code {sweep / '.code'}" in text for text in rank_logs(sweep).values())
    check_sweep_wandb([sweep / str(i) for i in range(3)], "loss.imp_min_coeff")


@pytest.mark.slow
def test_refused_gate_exits_3_on_every_rank(cluster, tmp_path: Path) -> None:
    proc, sweep, seconds = submit([*TWO_TASKS, *RUN, "memory.hbm_cap_gib=0.00001"], tmp_path,
                                  cluster)
    print(f"refused gate, 2 tasks: {seconds:.1f} s")
    assert proc.returncode == 3, (proc.stdout[-2000:], proc.stderr[-2000:])
    said = proc.stdout + proc.stderr
    assert "gate refused, exit 3 on every rank" in said and "Traceback" not in said
    report = load_json(sweep / "0" / "gate.json")
    assert report["fits"] is False
    logs = rank_logs(sweep)
    assert len(logs) == 2 and all("gate refused: exit 3" in t for t in logs.values()), logs
    (job,) = job_ids(sweep)
    steps = {r[0]: r for r in sacct(job, cluster)}
    assert steps[job][1] == "FAILED" and steps[job][2] == "3:0", steps
    assert not (sweep / "0" / "checkpoints").exists()
    # Rebuilt afterwards, the job's summary is the one the blocking run printed.
    status = pdecomp(["status", str(sweep)], tmp_path, cluster, timeout=120)
    assert status.returncode == 3 and "job 0" in status.stdout
    assert status.stdout in proc.stdout, (status.stdout, proc.stdout)


@pytest.mark.slow
def test_a_config_refused_in_the_job_is_the_sweeps_row_and_exit_2(cluster, tmp_path: Path
                                                                   ) -> None:
    """Only the job knows its devices: a mesh larger than them is refused there, on every
    rank, and the launcher reports the job's code and line (not "ended without a result")."""
    proc, sweep, _ = submit([*TWO_TASKS, *RUN, "mesh=fsdp8"], tmp_path, cluster)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    ended = load_json(sweep / "0" / "outcome.json")
    assert ended["exit_code"] == 2 and ended["reason"].startswith(
        "config error: mesh.gpus_per_host=8"), ended
    assert "Traceback" not in proc.stdout + proc.stderr


# -- helpers for the interrupted run ------------------------------------------------------

@pytest.mark.slow
def test_an_analysis_is_a_slurm_job_too(cluster, reference: Path, tmp_path: Path) -> None:
    """`pdecomp analyze RUN ... cluster=slurm --wait`: one SLURM job, running the copy of
    the code taken at submission, on the devices asked for; its report is the one the same
    analysis writes on this machine."""
    import pyarrow.parquet as pq

    there, here = tmp_path / "there", tmp_path / "here"
    for d in (there, here):
        shutil.copytree(reference, d)
    env = {**cluster, "PDECOMP_CPU_DEVICES": "2"}
    flags = ["--inputs", "1024", "--devices", "2"]
    proc = pdecomp(["analyze", str(there), *flags, "--wait", "cluster=slurm",
                    "hydra.launcher.cpus_per_task=2"], tmp_path, env, timeout=600)
    ok(proc)
    job = re.search(r"as slurm job (\d+)", proc.stdout).group(1)
    assert f"analysis job {job} ended: exit 0" in proc.stdout
    assert all(r[1] == "COMPLETED" for r in sacct(job, cluster)), sacct(job, cluster)
    log = (there / ".analysis-jobs" / job / f"{job}_0_log.err").read_text()
    assert f"code {there / '.analysis-jobs' / '.code'}" in log
    assert load_json(there / "analysis" / "gate.json")["n_devices"] == 2
    ok(pdecomp(["analyze", str(here), *flags], tmp_path, env, timeout=600))
    for table in sorted((here / "analysis" / "components").glob("*.parquet")):
        want = pq.read_table(table).to_pydict()
        got = pq.read_table(there / "analysis" / "components" / table.name).to_pydict()
        assert got == want, table.name


def wait_for(read, done, seconds: float, runner: subprocess.Popen) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = read()
        if done(value):
            return value
        if runner.poll() is not None:
            _, err = runner.communicate()
            pytest.fail(f"pdecomp ended early ({runner.returncode}): {err[-2000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {seconds}s waiting; last: {str(value)[-2000:]}")


def _pending(job: str, env: dict[str, str]) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                         text=True, timeout=60, check=False).stdout
    return "PENDING" in out

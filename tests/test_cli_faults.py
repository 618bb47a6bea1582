"""How runs end when something goes wrong after composing: output directories that cannot be
made, refusals inside the job, sweeps with failing jobs, and stop signals outside SLURM.

Every case runs the real console script in a fresh working directory and checks what it
leaves on disk as well as its exit code and its one line.
"""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PDECOMP, load_json, ok, pdecomp

# A few seconds of TMS training.
TINY = ["optim.steps=40", "logging.log_every=10", "model.train_steps=500",
        "data.batch_size=256", "data.eval_batches=1", "optim.faith_warmup_steps=10"]


def one_line(proc: subprocess.CompletedProcess[str], code: int, *texts: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    for text in texts:
        assert text in last, f"{text!r} not in: {last}"
    return last


def entries(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


# -- output directories that cannot be made: refused before Hydra makes anything ------------

@pytest.mark.parametrize(("args", "key"), [
    (["hydra.run.dir=a_file"], "hydra.run.dir=a_file"),  # a file where the directory goes
    (["hydra.run.dir=a_file/run"], "hydra.run.dir=a_file/run"),  # a file among its parents
    (["-m", "hydra.sweep.dir=a_file/sweep", "seed=0,1"], "hydra.sweep.dir=a_file/sweep"),
    (["cluster=local", "hydra.sweep.dir=a_file"], "hydra.sweep.dir=a_file"),  # one submitted job
])
def test_an_output_directory_in_the_way_exits_2_naming_the_key(
        args: list[str], key: str, env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("mine")
    before = entries(tmp_path)
    line = one_line(pdecomp([*TINY, *args], tmp_path, env), 2, "config error:", key,
                    "a_file is not a directory")
    assert line.startswith("config error:")
    assert entries(tmp_path) == before and (tmp_path / "a_file").read_text() == "mine"


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Path:
    """A read-only file system (a tmpfs mounted ro): root, which CI runs as, may write in
    any directory whatever its mode, but not there."""
    d = tmp_path / "ro"
    d.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    yield d
    subprocess.run(["umount", str(d)], check=True)


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_a_read_only_output_directory_exits_2_naming_the_key(
        key: str, read_only_dir: Path, env: dict[str, str], tmp_path: Path) -> None:
    sweep = ["-m", "seed=0,1"] if key == "hydra.sweep.dir" else []
    one_line(pdecomp([*TINY, *sweep, f"{key}={read_only_dir}/out"], tmp_path, env), 2,
             f"config error: {key}={read_only_dir}/out", "Read-only file system")
    assert list(read_only_dir.iterdir()) == []


# -- refused inside the job: the directories the run made are taken back -------------------

@pytest.mark.parametrize(("run_dir", "existing"), [
    (None, None),  # Hydra's outputs/<name>/<time>, none of it there before
    (None, "outputs/mine.txt"),  # outputs/ there before (and stays)
    ("new/nested/run", None),
])
def test_a_refusal_in_the_job_leaves_no_directory_behind(
        run_dir: str | None, existing: str | None, env: dict[str, str], tmp_path: Path) -> None:
    """Only the job knows its devices; a mesh larger than them is refused there, and the
    directories made for the run are taken back."""
    if existing:
        (tmp_path / existing).parent.mkdir(parents=True)
        (tmp_path / existing).write_text("mine")
    before = entries(tmp_path)
    args = [f"hydra.run.dir={run_dir}"] if run_dir else []
    one_line(pdecomp([*TINY, "mesh=fsdp8", *args], tmp_path, env), 2,
             "config error: mesh.gpus_per_host=8")
    assert entries(tmp_path) == before


@pytest.mark.slow  # whole CLI runs, alike under every jax: the full suite, not the fast tier
def test_a_refused_resume_leaves_the_run_directory_as_it_was(
        env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ok(pdecomp([*TINY, f"hydra.run.dir={run_dir}"], tmp_path, env))
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    one_line(pdecomp([*TINY, "mesh=fsdp8", f"hydra.run.dir={run_dir}"], tmp_path, env), 2,
             "mesh.gpus_per_host=8")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files


# -- sweeps: every job runs; the summary says how each ended; the worst code ---------------

def sweep(args: list[str], env: dict[str, str], tmp_path: Path
          ) -> tuple[subprocess.CompletedProcess[str], Path, list[dict[str, str]]]:
    sweep_dir = tmp_path / "sweep"
    proc = pdecomp(["-m", *TINY, *args, f"hydra.sweep.dir={sweep_dir}"], tmp_path, env,
                   timeout=600)
    with (sweep_dir / "sweep_summary.csv").open() as f:
        return proc, sweep_dir, list(csv.DictReader(f))


@pytest.mark.slow  # whole CLI runs, alike under every jax: the full suite, not the fast tier
def test_a_sweep_runs_every_job_and_exits_with_the_refused_gate(
        env: dict[str, str], tmp_path: Path) -> None:
    proc, sweep_dir, rows = sweep(["mesh=fsdp8,local", "memory.hbm_cap_gib=0,0.001"],
                                  env, tmp_path)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    ended = {(r["mesh"], r["memory.hbm_cap_gib"]): r for r in rows}
    assert {k: r["exit_code"] for k, r in ended.items()} == {
        ("fsdp8", "0"): "2", ("fsdp8", "0.001"): "2", ("local", "0"): "0",
        ("local", "0.001"): "3"}
    assert ended[("fsdp8", "0")]["reason"].startswith("config error: mesh.gpus_per_host=8")
    assert ended[("local", "0.001")]["reason"].startswith("gate refused")
    ok_job = next(p for p in sweep_dir.iterdir() if (p / "summary.json").exists())
    assert load_json(ok_job / "summary.json")["steps"] == 40
    assert "3 of 4 jobs failed; exit 3" in proc.stdout
    # the table, written to a file (not a terminal), keeps its headers and reasons whole
    assert "memory.hbm_cap_gib" in proc.stdout and "config error: mesh.gpus_per_host=8" \
        in proc.stdout, proc.stdout


@pytest.mark.slow  # whole CLI runs, alike under every jax: the full suite, not the fast tier
def test_a_sweep_with_a_crashed_job_runs_the_rest_and_exits_with_the_refused_config(
        env: dict[str, str], tmp_path: Path) -> None:
    """A job that fails (a non-finite loss) is a row with its reason and the next job runs;
    a refused config outranks a failure in the sweep's code."""
    proc, _, rows = sweep(["optim.components.lr=1e30,0.001", "mesh=local,fsdp8"],
                          env, tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    blown, refused, fine, _ = sorted(rows, key=lambda r: int(r["job"]))  # the values' order
    assert blown["exit_code"] == "1"
    assert blown["reason"].startswith("error: non-finite loss at step 10"), blown
    assert refused["exit_code"] == "2" and fine["exit_code"] == "0" and fine["loss/total"]
    assert "3 of 4 jobs failed; exit 2" in proc.stdout


# -- stop signals outside SLURM: a checkpoint at the next step, exit 128 + the signal -------

@pytest.mark.slow  # whole CLI runs, alike under every jax: the full suite, not the fast tier
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_checkpoints_and_the_run_resumes(
        sig: signal.Signals, code: int, env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["optim.steps=20000", "logging.ckpt_every=0", "logging.stop_check_every=1",
            "model.train_steps=500", "data.batch_size=64", "data.eval_batches=1",
            f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen([PDECOMP, *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    for line in proc.stderr:  # training has started once the first progress line is out
        if ": step " in line:
            break
    time.sleep(0.5)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{sig.name}: stopped at step ") and f"exit {code}" in last, last
    step = int(last.split("stopped at step ")[1].split(";")[0])
    assert 0 < step < 20000
    assert (run_dir / "checkpoints" / str(step)).is_dir()
    # resumed by the command the line names (with fewer steps, allowed explicitly) from that
    # very step, to the end
    assert f"resume with `pdecomp resume {run_dir}`" in last, last
    resumed = ok(pdecomp(["resume", str(run_dir), f"optim.steps={step + 10}",
                          "optim.allow_schedule_change=true"], tmp_path, env))
    assert f"resumed from checkpoint at step {step}" in resumed.stderr + resumed.stdout
    assert load_json(run_dir / "summary.json")["steps"] == step + 10


@pytest.mark.slow  # whole CLI runs, alike under every jax: the full suite, not the fast tier
def test_model_path_names_the_run_after_the_model(env: dict[str, str], tmp_path: Path) -> None:
    fixture = Path(__file__).parent / "fixtures" / "llama" / "gqa_llama3"
    sites = "layers.sites=[layers.1.mlp.gate_proj,layers.1.mlp.up_proj,layers.1.mlp.down_proj]"
    proc = ok(pdecomp(["+experiment=llama_tiny_chunkwise", f"model.path={fixture}", sites,
                       "gate.only=true"], tmp_path, env))
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["gqa_llama3"]
    assert "llama_tiny" not in proc.stderr + proc.stdout


def test_ctrl_c_outside_training_exits_130_with_one_line(env: dict[str, str],
                                                         tmp_path: Path) -> None:
    """A gate-only run has no step to stop at: Ctrl-C ends it at once, without a trace (the
    8B preset's gate: its compile takes a minute or more, so the signal finds it running)."""
    proc = subprocess.Popen([PDECOMP, "+experiment=llama8b_l18-26_chunkwise", "gate.only=true",
                             "gate.target=b200", "mesh=fsdp8x8"],
                            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / "outputs").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # Hydra has started the job
    time.sleep(1)  # in the job: building the state's shapes, tracing or compiling
    assert proc.poll() is None, "the gate ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and err.strip().splitlines()[-1] == \
        "interrupted (Ctrl-C): exit 130", err[-3000:]


def test_ctrl_c_says_so_while_stderr_is_silenced(tmp_path: Path) -> None:
    """Loading the CUDA compile plugin points fd 2 at /dev/null for a moment; a Ctrl-C there
    still ends with its line on the stderr the process started with."""
    script = ("import functools, os, signal, sys\n"
              "from launcher import cluster\n"
              "signal.signal(signal.SIGINT, functools.partial(cluster.interrupted,"
              " stderr_fd=os.dup(2)))\n"
              "from pdecomp.core.hardware import _quiet_stderr\n"
              "with _quiet_stderr():\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    signal.pause()\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 130 and proc.stderr == "interrupted (Ctrl-C): exit 130\n", proc


@pytest.mark.slow  # whole CLI runs, alike under every jax: the full suite, not the fast tier
def test_submitit_local_jobs_end_the_same_way(env: dict[str, str], tmp_path: Path) -> None:
    """The same rows and code through submitit's local executor as in this process."""
    proc, _, rows = sweep(["cluster=local", "mesh=local,fsdp8"], env, tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert [r["exit_code"] for r in rows] == ["0", "2"]
    assert rows[1]["reason"].startswith("config error: mesh.gpus_per_host=8"), rows[1]

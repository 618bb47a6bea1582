"""A disk that fills during a run, on a real file system: a small tmpfs holds the run
directory, and a filler file takes its last free bytes at a chosen point of the run (before
a checkpoint's save, or before the final results are written), so every ENOSPC comes from
the kernel. The run must end with one line and exit 1, keep its last complete checkpoint,
and, once the filler is gone, resume from it to the result of an uninterrupted run.

The filler is placed from inside the run: a few lines wrap `Checkpointer.save` (after the
previous save is complete, so that one is on disk) or `pdecomp.run.decompose.evaluate`, then call the
CLI's own entry point. Mounting a tmpfs needs root (or CAP_SYS_ADMIN); elsewhere these skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from conftest import load_json, ok, pdecomp

# Whole CLI runs on a real tmpfs, alike under every jax: the full suite, not the fast tier.
pytestmark = pytest.mark.slow

RUN = ["optim.steps=40", "logging.log_every=10", "logging.ckpt_every=10",
       "model.train_steps=500", "data.batch_size=256", "data.eval_batches=1",
       "optim.faith_warmup_steps=10"]
DISK = "8m"  # a run directory (4 checkpoints' worth at most, wandb's files) takes < 1 MiB

# argv: where to fill the disk (a step whose save it precedes, or "results"), how many
# bytes to leave free, the filler's path; then the CLI's arguments.
FILL_THEN_RUN = textwrap.dedent("""
    import os, sys
    from pathlib import Path

    where, leave, filler = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])

    def fill():
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        for chunk in (1 << 16, 1 << 12):
            try:
                while True:
                    os.write(fd, bytes(chunk))
            except OSError:  # ENOSPC: the disk is full
                pass
        os.close(fd)
        os.truncate(filler, max(filler.stat().st_size - leave, 0))

    if where == "results":
        import pdecomp.run.decompose as run
        evaluate = run.evaluate
        def fill_then_evaluate(*args, **kwargs):
            fill()
            return evaluate(*args, **kwargs)
        run.evaluate = fill_then_evaluate
    else:
        from pdecomp.run.checkpoint import Checkpointer
        save = Checkpointer.save
        def fill_then_save(self, step, state):
            if step == int(where):
                self.wait()  # the checkpoints before this one are whole
                fill()
            return save(self, step, state)
        Checkpointer.save = fill_then_save

    sys.argv = ["pdecomp", *sys.argv[4:]]
    from launcher.app import main
    main()
""")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of DISK bytes, unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the disk-full tests mount a small tmpfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): "
                    f"{proc.stderr.strip()}")
    yield mnt
    if subprocess.run(["umount", str(mnt)], check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], check=False)  # busy: detach it


@pytest.fixture(scope="module")
def uninterrupted(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run, never stopped (and the toy target trained and cached, once)."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    ok(pdecomp([*RUN, f"hydra.run.dir={cwd / 'run'}"], cwd, env))
    return cwd / "run"


def fill_then_run(where: str, leave: int, run_dir: Path, cwd: Path, env: dict[str, str]
                  ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", FILL_THEN_RUN, where, str(leave),
         str(run_dir.parent / "filler"), *RUN, f"hydra.run.dir={run_dir}"],
        cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=300)


def failed_with(proc: subprocess.CompletedProcess[str], line: str) -> None:
    """Exit 1, and `line` the last of stderr (what comes before it is the gate's report
    and the progress), with no traceback or log record of the fault anywhere."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, (proc.returncode, out[-3000:])
    assert proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-3000:]
    for noise in ("Traceback", "Logging error", "ERROR", "Errno", "RESOURCE_EXHAUSTED"):
        assert noise not in out, out[-3000:]


def no_partial_files(run_dir: Path) -> None:
    left = [p for p in run_dir.rglob("*") if p.name.endswith(".tmp") or "-tmp" in p.name]
    assert left == [], left


def resume_matches(run_dir: Path, uninterrupted: Path, from_step: int, cwd: Path,
                   env: dict[str, str]) -> None:
    """The filler gone, the same command resumes at `from_step` and ends where a run that
    was never stopped ends: the same summary, history and final state."""
    (run_dir.parent / "filler").unlink()
    proc = ok(pdecomp([*RUN, f"hydra.run.dir={run_dir}"], cwd, env))
    assert f"resumed from checkpoint at step {from_step}" in proc.stderr, proc.stderr[-3000:]

    def timeless(d: dict) -> dict:  # timings and the plots' paths differ
        return {k: v for k, v in d.items() if not k.startswith(("perf/", "plots/"))}

    assert timeless(load_json(run_dir / "summary.json")) == \
        timeless(load_json(uninterrupted / "summary.json"))
    assert [timeless(h) for h in load_json(run_dir / "history.json")] == \
        [timeless(h) for h in load_json(uninterrupted / "history.json")]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["30", "40"]
    for a, b in zip(final_state(run_dir), final_state(uninterrupted), strict=True):
        assert np.array_equal(a, b)


def final_state(run_dir: Path) -> list[np.ndarray]:
    from pdecomp.run.load import load_run

    state = load_run(run_dir, log=lambda _: None).state
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state, eqx.is_array))]


def test_disk_full_at_a_checkpoint_keeps_the_one_before_and_resumes_from_it(
        disk: Path, uninterrupted: Path, env: dict[str, str], cache, tmp_path: Path) -> None:
    run_dir = disk / "run"
    proc = fill_then_run("20", 0, run_dir, tmp_path, env)
    failed_with(proc, f"cannot write the checkpoint at step 20 in {run_dir / 'checkpoints'}: "
                      "no space left on device; the last complete checkpoint, step 10, is "
                      f"intact; resume with hydra.run.dir={run_dir}")
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["10"]
    no_partial_files(run_dir)
    resume_matches(run_dir, uninterrupted, 10, tmp_path, env)


def test_disk_full_in_the_final_checkpoint_keeps_the_one_before_and_resumes_from_it(
        disk: Path, uninterrupted: Path, env: dict[str, str], cache, tmp_path: Path) -> None:
    run_dir = disk / "run"
    # Room for part of the checkpoint: the save fails half-way through its files.
    proc = fill_then_run("40", 48 << 10, run_dir, tmp_path, env)
    failed_with(proc, f"cannot write the checkpoint at step 40 in {run_dir / 'checkpoints'}: "
                      "no space left on device; the last complete checkpoint, step 30, is "
                      f"intact; resume with hydra.run.dir={run_dir}")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["20", "30"]
    assert not (run_dir / "summary.json").exists()
    no_partial_files(run_dir)
    resume_matches(run_dir, uninterrupted, 30, tmp_path, env)


def test_disk_full_writing_the_results_keeps_the_final_checkpoint(
        disk: Path, uninterrupted: Path, env: dict[str, str], cache, tmp_path: Path) -> None:
    run_dir = disk / "run"
    proc = fill_then_run("results", 0, run_dir, tmp_path, env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    written = line.removeprefix("cannot write ").split(":")[0]
    assert Path(written).parent == run_dir, line  # a plot or summary.json, named
    failed_with(proc, f"cannot write {written}: no space left on device; resume with "
                      f"hydra.run.dir={run_dir}")
    assert not (run_dir / "summary.json").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["30", "40"]
    no_partial_files(run_dir)
    resume_matches(run_dir, uninterrupted, 40, tmp_path, env)


def test_a_write_failure_is_told_from_other_errors(tmp_path: Path) -> None:
    from pdecomp.core.storage import WriteFailed, atomic_write, storage_error

    assert storage_error(OSError(28, os.strerror(28))) == "no space left on device"
    tensorstore = ValueError("RESOURCE_EXHAUSTED: Failed writing: [os_error_code='122']")
    assert storage_error(tensorstore) == os.strerror(122).lower()  # disk quota exceeded
    safetensors = ValueError("Error while serializing: I/O error: No space left on device "
                             "(os error 28)")  # Rust's io::Error, as safetensors words it
    assert storage_error(safetensors) == "no space left on device"
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as wrapped:
        assert storage_error(wrapped) == "no space left on device"
    assert storage_error(ValueError("a bug")) is None

    def half_then_full(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    (tmp_path / "a.json").write_text(json.dumps({"kept": True}))
    with pytest.raises(WriteFailed, match=r"a\.json: no space left on device$"):
        atomic_write(tmp_path / "a.json", half_then_full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no half file left
    assert load_json(tmp_path / "a.json") == {"kept": True}
    with pytest.raises(ZeroDivisionError):  # not a fault of the disk: raised as it is
        atomic_write(tmp_path / "b.json", lambda tmp: 1 / 0)


def test_a_rank_of_several_leaves_at_once() -> None:
    """In a job of several processes the rank whose write failed exits without running its
    exit handlers: jax.distributed's would wait there for ranks that are still working."""
    script = textwrap.dedent("""
        import atexit
        from launcher import cluster
        atexit.register(lambda: print("exit handlers ran"))
        cluster.leave(cluster.Ranks(process_id=1, num_processes=2), "cannot write x", 1)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=False, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == "[rank 1/2] cannot write x\n" and proc.stdout == "", proc

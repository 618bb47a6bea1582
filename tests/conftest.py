"""Fixtures shared by the CLI tests: the installed `pdecomp` script and a clean environment."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _one_compilation_cache_per_run() -> None:
    """JAX's persistent compilation cache, shared by every process of this test run (this
    one, xdist's workers, each CLI subprocess: they inherit the environment) and by nothing
    else: a directory made fresh for the run, so no run reads another run's, or another jax
    version's, executables. Most of the suite's time is XLA compiling the same small steps
    again in new processes. PDECOMP_TEST_NO_CACHE=1 runs the suite without it."""
    names = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
    if os.environ.get("PDECOMP_TEST_NO_CACHE") == "1":
        for name in names:
            os.environ.pop(name, None)
        return
    if os.environ.get(_RUN_CACHE) is None:  # the run's first process: xdist's controller
        os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="pdecomp-test-jax-cache-")
        atexit.register(shutil.rmtree, os.environ[_RUN_CACHE], ignore_errors=True)
    os.environ.update(dict(zip(names, (os.environ[_RUN_CACHE], "0", "-1"), strict=True)))
    # the gate's forecast measures this CPU once for the whole run, not in the user's cache
    os.environ.setdefault("PDECOMP_CALIBRATION_DIR",
                          os.path.join(os.environ[_RUN_CACHE], "calibration"))


_RUN_CACHE = "PDECOMP_TEST_RUN_CACHE"
# Before anything imports jax, which reads these once.
_one_compilation_cache_per_run()

from launcher import cluster
from pdecomp.core import hardware

# Before JAX starts its backends: the in-process deviceless gates compile as the CLI's do.
hardware.no_gpu_autotuning_without_gpus()


def console_script(name: str) -> str:
    """The project's virtualenv script `name`, else whatever is on PATH."""
    p = Path(sys.executable).parent / name
    return str(p) if p.exists() else (shutil.which(name) or name)


PDECOMP = console_script("pdecomp")


def pdecomp(args: list[str], cwd: Path, env: dict[str, str],
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The `pdecomp` console script, run to its end; its output captured."""
    return subprocess.run([PDECOMP, *args], check=False, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


WANDB = console_script("wandb")


def leet(args: list[str]) -> str:
    """`wandb leet inspect`: an offline run's files read back, as wandb reads them."""
    proc = subprocess.run([WANDB, "leet", "inspect", *args], check=False, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    return proc.stdout


def wandb_run_dirs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def wandb_run(run_dir: Path) -> dict[str, Any]:
    """The offline wandb run a job left in `run_dir`: its summary view (name, tags, config)
    with the run record's group and job type."""
    (wb_dir,) = wandb_run_dirs(run_dir)
    run = json.loads(leet(["--summary", "--json", str(wb_dir)]))
    records = [json.loads(line) for line in leet(["--json", str(wb_dir)]).splitlines() if line]
    record = next(r["run"] for r in records if r.get("type") == "run")
    return {**run, "group": record.get("run_group"), "job_type": record.get("job_type")}


def check_sweep_wandb(job_dirs: list[Path], key: str) -> None:
    """Each job of a sweep over `key` left a wandb run named for its value of `key` (names
    distinct), all in one group, with the preset, its overrides, pdecomp's version and the
    commit in its config."""
    runs = [wandb_run(d) for d in job_dirs]
    assert len({r["name"] for r in runs}) == len(runs), [r["name"] for r in runs]
    assert len({r["group"] for r in runs}) == 1 and runs[0]["group"], [r["group"] for r in runs]
    for r in runs:
        mine = [o for o in r["config"]["pdecomp"]["overrides"] if o.startswith(f"{key}=")]
        assert len(mine) == 1 and r["name"].endswith(mine[0]), (r["name"], mine)
        assert r["job_type"] == "decompose" and r["config"]["pdecomp"]["pdecomp"]
        assert r["config"]["pdecomp"]["commit"], r["config"]["pdecomp"]


def copy_of(finished: tuple[Path, subprocess.CompletedProcess[str]], dest: Path) -> Path:
    """A module's shared finished run (its directory and the process that made it), checked
    and copied to `dest`, so a test can resume or damage it and leave the shared one as it
    is for the others."""
    src, proc = finished
    ok(proc)
    shutil.copytree(src, dest)
    return dest


def load_json(path: Path) -> Any:
    assert path.is_file(), f"missing {path}"
    return json.loads(path.read_text())


TESTS_DIR = str(Path(__file__).resolve().parent)


def cpu_device_flags(n: int) -> str:
    """XLA_FLAGS for `n` simulated CPU devices. Under jaxlib 0.11, with more than one XLA:CPU
    device, LLVM's loop vectorizer ran past 10 minutes on llama_tiny's step with the global
    CI transformer (an unbounded recursion in its VPlan uniformity analysis; 8 s with one
    device, bench/RESULTS.md); these processes compile at LLVM -O0, and compare only
    against what they compute themselves, since -O0 also rounds differently (no FMA)."""
    from importlib.metadata import version

    flags = f"--xla_force_host_platform_device_count={n}"
    major_minor = tuple(int(p) for p in version("jaxlib").split(".")[:2])
    return flags + (" --xla_backend_optimization_level=0" if n > 1 and major_minor >= (0, 11)
                    else "")


def cpu_device_env(n: int) -> dict[str, str]:
    """The environment of a process with `n` simulated CPU devices, its XLA thread pools
    sized as the launcher sizes them (`launcher.cluster.cpu_device_threads`)."""
    return {"XLA_FLAGS": cpu_device_flags(n), "JAX_PLATFORMS": "cpu",
            "NPROC": cluster.cpu_device_threads(n)}


def run_on_cpu_devices(script: str, n: int, *args: str, timeout: int = 600) -> Any:
    """Run `script` in a fresh Python with `n` simulated CPU devices (the device count is
    fixed when JAX starts, hence the subprocess); its last stdout line, parsed as JSON.
    The script can import the tests' helpers (`from conftest import train_on_all_devices`)."""
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **cpu_device_env(n), "PYTHONPATH": path}
    res = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                         text=True, check=False, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def train_on_all_devices(cfg: Any, target_seed: int, state_seed: int, batches: list[Any]
                         ) -> tuple[Any, list[dict[str, float]]]:
    """One train step of `cfg` per batch on a data mesh of every device (state replicated,
    batch split): the final state and each step's metrics."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pdecomp.kinds import cache as targets
    from pdecomp.plan.resolve import resolve
    from pdecomp.spd.step import init_state, make_train_step, scalars

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    target = jax.device_put(targets.init_target(jax.random.PRNGKey(target_seed), cfg.model), rep)
    spec = resolve(cfg).step
    state = jax.device_put(init_state(jax.random.PRNGKey(state_seed), spec, target), rep)
    step = jax.jit(make_train_step(spec))
    history = []
    for batch in batches:
        state, m = step(state, target, jax.device_put(batch, shard))
        # More simulated devices than cores: waiting on each step keeps collectives fed.
        jax.block_until_ready(m)
        history.append(scalars(m, spec.sites.names))
    return state, history


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A toy-target cache shared by the module (targets train once); wandb offline, with its
    files in each run directory (the launcher's default when no WANDB_*_DIR is set)."""
    e = dict(os.environ)
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        e.pop(var, None)
    e.update(PDECOMP_CACHE=str(tmp_path_factory.mktemp("pdecomp_cache")),
             WANDB_MODE="offline", WANDB_SILENT="true")
    return e


@pytest.fixture(scope="module")
def cache(env: dict[str, str]) -> Iterator[None]:
    """`env`'s target cache for what the module runs in this process too (decompose,
    load_run), restored afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDECOMP_CACHE", env["PDECOMP_CACHE"])
        yield


# The test files that take longest (`pytest --durations`, bench/RESULTS.md), longest first.
# `make test` hands whole files to its workers in collection order (`--dist loadfile
# --no-loadscope-reorder`): started first, they run beside the many short files instead of
# leaving one worker alone with one of them at the end.
LONGEST_FIRST = ("test_cli_lm.py", "test_slurm.py", "test_cli_journeys.py", "test_cli_bad_input.py",
                 "test_analyze.py", "test_fit_batch.py", "test_lm.py", "test_gate.py",
                 "test_semantics.py", "test_cli_faults.py", "test_packaging.py",
                 "test_disk_full.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


# A report's required fields, each test setting the ones it reads.
_REPORT = {"target": "t", "mesh": {"data": 1}, "n_devices": 1, **{f"{k}_bytes": 0 for k in (
    "argument", "output", "temp", "alias", "host_temp", "host_argument", "peak", "xla_peak",
    "cap", "headroom")}, "cap_source": "memory.hbm_cap_gib", "fits": True, "compile_s": 1.0,
    "flops": None, "matmul_flops": None, "jax": "", "jaxlib": "", "xla_flags": "",
    "argument_parts_bytes": {}, "largest_temps": [], "step": None}


def gate_report(**fields):
    """A GateReport of made-up figures, the test's own fields over zeros."""
    from pdecomp.gate.report import GateReport

    return GateReport(**{**_REPORT, **fields})

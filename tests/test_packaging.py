"""The built wheel, installed into a fresh virtualenv, works outside the source tree: the
configs come with it (package data), its requirements hold (`pip check`), and Hydra finds
the SLURM launcher plugin."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ok

ROOT = Path(__file__).resolve().parent.parent
# What the wheel is built from: the packages and the files pyproject.toml reads.
SOURCES = ("pyproject.toml", "README.md", "pdecomp", "launcher", "hydra_plugins")
WHERE = "import launcher.app, pdecomp; print(launcher.app.CONF_DIR); print(pdecomp.__file__)"
API = ("from launcher import api; run = api.load_run('tms'); "
       "cfg = api.compose(['optim.steps=50', 'optim.faith_warmup_steps=10', "
       "'logging.wandb.mode=disabled']); print(run.step, run.config == cfg)")
# Hydra's own plugin scan, which any Hydra app in the environment runs at start.
LAUNCHERS = ("from hydra.core.plugins import Plugins; "
             "from hydra.plugins.launcher import Launcher; "
             "print([c.__module__ for c in Plugins.instance().discover(Launcher)])")


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False,
                          timeout=timeout)


def build_wheel(tmp: Path, env: dict[str, str]) -> Path:
    """The wheel of a copy of the working tree's sources (the build writes into the tree it
    builds, and the checkout is not this test's to write)."""
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    ok(run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"),
            str(src)], tmp, env))
    (wheel,) = (tmp / "dist").glob("pdecomp-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("WANDB_")}
    env.update(PDECOMP_CACHE=str(tmp_path / "cache"), WANDB_MODE="offline",
               WANDB_SILENT="true")
    wheel = build_wheel(tmp_path, env)

    venv = tmp_path / "venv"
    ok(run([sys.executable, "-m", "venv", str(venv)], tmp_path, env))
    python, pdecomp = str(venv / "bin" / "python"), str(venv / "bin" / "pdecomp")
    # The dependencies are this environment's, the pinned ones (`make install`), seen through
    # a path entry after the new venv's own packages: reinstalling them from pip's cache was
    # a minute of the suite. What is installed is the wheel alone, and `pip check` then
    # holds its requirements against what the venv sees.
    (own,) = (p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()
              and Path(p).is_relative_to(Path(sys.prefix)))
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "pdecomp_test_deps.pth").write_text(own + "\n")
    ok(run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], tmp_path, env))
    ok(run([python, "-m", "pip", "check"], tmp_path, env))
    work = tmp_path / "elsewhere"
    work.mkdir()

    where = ok(run([python, "-c", WHERE], work, env))
    for line in where.stdout.split():
        assert Path(line).is_relative_to(venv), line  # the installed copy, not the checkout

    gate = ok(run([pdecomp, "gate.only=true", "logging.wandb.mode=disabled",
                   "hydra.run.dir=gate"], work, env))
    assert json.loads((work / "gate" / "gate.json").read_text())["fits"], gate.stdout[-2000:]

    ok(run([pdecomp, "optim.steps=50", "optim.faith_warmup_steps=10", "logging.wandb.mode=disabled",
            "hydra.run.dir=tms"], work, env))
    summary = json.loads((work / "tms" / "summary.json").read_text())
    assert summary["steps"] == 50 and "mmcs/linear1" in summary
    # The Python API, installed: composes from the packaged configs, opens the CLI's run.
    api = ok(run([python, "-c", API], work, env))
    assert api.stdout.split()[-2:] == ["50", "True"], api.stdout[-2000:]

    ok(run([pdecomp, "+experiment=llama_tiny_chunkwise", "gate.only=true",
            "logging.wandb.mode=disabled", "hydra.run.dir=llama"], work, env))
    assert (work / "llama" / "gate.json").is_file()

    # Hydra's plugin scan finds the SLURM launcher, and `cluster=slurm` composes with it.
    found = ok(run([python, "-c", LAUNCHERS], work, env))
    assert "hydra_plugins.pdecomp_launcher.slurm_launcher" in found.stdout
    defaults = ok(run([pdecomp, "--info", "defaults", "cluster=slurm"], work, env))
    assert "hydra/launcher/pdecomp_slurm" in defaults.stdout


@pytest.mark.parametrize("cuda", ["12", "13"])
def test_the_gpu_extras_take_the_cuda_plugin_at_jaxlibs_version(cuda: str) -> None:
    """`pip install pdecomp[cudaN]` (make install-gpu) asks for jax's own extra, which pins
    its CUDA plugin to jax's version; the constraints pin jax to jaxlib's."""
    import tomllib
    from importlib.metadata import requires, version

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras[f"cuda{cuda}"] == [f"jax[cuda{cuda}]"]
    pins = [r for r in requires("jax") or [] if f'extra == "cuda{cuda}"' in r]
    assert any(r.startswith(f"jax-cuda{cuda}-plugin") and f"<={version('jax')}" in r
               for r in pins), pins
    assert version("jax") == version("jaxlib")

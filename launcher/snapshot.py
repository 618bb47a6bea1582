"""The code a queued SLURM job runs: a copy of pdecomp's packages and configs taken when the
job is submitted (`<sweep dir>/.code/<time>`), put first on the job's PYTHONPATH.

A job may wait in the queue for days while its checkout moves on (a pull, an edit, another
branch); without the copy it would run whatever the checkout holds when it starts. The copy
records the commit it was taken from (`COMMIT`, which `pdecomp.plan.resolve.provenance` reads
there), so the run's summary and wandb name what it ran. Copied: the importable packages
only (a few hundred KB), not the environment they import.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Any

# What `import pdecomp`, `import launcher` and the SLURM plugin load, relative to their root.
PACKAGES = ("pdecomp", "launcher", "hydra_plugins/pdecomp_launcher")
COMMIT_FILE = "COMMIT"


def code_root() -> Path:
    """The directory holding the running packages (a checkout or site-packages)."""
    import launcher

    return Path(launcher.__file__).resolve().parents[1]


def take(dest: Path) -> Path:
    """Copy the running packages to `dest` (new), with the commit they are from."""
    from pdecomp.plan.resolve import provenance

    root, tmp = code_root(), dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    for package in PACKAGES:
        shutil.copytree(root / package, tmp / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (tmp / COMMIT_FILE).write_text(provenance()["commit"] or "")
    tmp.rename(dest)
    return dest


def setup_line(code: Path) -> str:
    """The sbatch line that makes the job import the copy before any installed pdecomp."""
    return f"export PYTHONPATH={shlex.quote(str(code))}${{PYTHONPATH:+:$PYTHONPATH}}"


def use_configs(config_loader: Any) -> None:
    """In a job: compose from the configs of the code it runs (the copy's, when it runs one),
    not those of the checkout it was submitted from, which Hydra's pickled search path
    names."""
    conf_dir = str(code_root() / "launcher" / "conf")  # launcher.app.CONF_DIR of this code
    search_path = config_loader.config_search_path
    mains = [e for e in search_path.get_path() if e.provider == "main"]
    if all(e.path == conf_dir for e in mains):
        return
    for e in mains:
        e.path = conf_dir
    config_loader.repository.initialize_sources(search_path)

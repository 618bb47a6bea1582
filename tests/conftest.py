"""Fixtures shared by the CLI tests: the installed `pdecomp` script and a clean environment."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest


def console_script(name: str) -> str:
    """The project's virtualenv script `name`, else whatever is on PATH."""
    p = Path(sys.executable).parent / name
    return str(p) if p.exists() else (shutil.which(name) or name)


PDECOMP = console_script("pdecomp")


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

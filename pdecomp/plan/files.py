"""The run directory's files, each written whole by the main process (rank 0): what the
user composed (config.yaml), what it resolved to (run.json), the gate's report
(gate.json), the metrics as logged (history.json) and at the end (summary.json)."""

from __future__ import annotations

import dataclasses as dc
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from pdecomp.core import processes as hosts
from pdecomp.core import storage
from pdecomp.plan.resolve import Run

CONFIG_FILE = "config.yaml"  # the RunConfig as composed
RUN_FILE = "run.json"  # the resolved run (`Run.record`), which `pdecomp.run.load.load_run` reads


def write_json(path: Path, obj: Any) -> None:
    """Write atomically: a reader never sees half a file; WriteFailed on a full disk. Rank 0
    only."""
    if hosts.is_main_process():
        storage.write_text(path, json.dumps(obj, indent=1, default=_jsonable))


def write_config(run: Run, run_dir: Path) -> None:
    """The config as composed, as plain YAML (tuples as lists), atomically. Rank 0 only."""
    if not hosts.is_main_process():
        return
    plain = json.loads(json.dumps(dc.asdict(run.composed)))
    storage.write_text(run_dir / CONFIG_FILE,
                       yaml.safe_dump(plain, sort_keys=False, allow_unicode=True))


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.generic, jax.Array)):
        return np.asarray(x).tolist()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x))

"""`pdecomp resume <run dir> [overrides]`: the command that made a run, run again in its
directory from wherever you are: its own overrides (Hydra's record in `.hydra/`), its paths
as they were resolved when it started (run.json), then yours. It resumes from the run's
last checkpoint as running that command again would."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pdecomp.core.exits import EXIT_BAD_CONFIG, Refused
from pdecomp.core.storage import DamagedFile, read_json, read_yaml

USAGE = "usage: pdecomp resume <run dir> [overrides ...]"
PATH_KEYS = ("model.path", "data.path")


def command_line(args: list[str]) -> list[str]:
    """The overrides that resume the run in `args[0]`, with `args[1:]` after its own; a run
    directory that pdecomp did not make ends the process with one line, exit 2."""
    if not args or args[0].startswith("-"):
        _refuse(USAGE)
    run_dir = Path(args[0]).expanduser().absolute()
    recorded = run_dir / ".hydra" / "overrides.yaml"
    if not recorded.is_file():
        why = "does not exist" if not run_dir.is_dir() else "has no .hydra/overrides.yaml"
        _refuse(f"{run_dir}: not a run directory pdecomp made ({why})")
    try:
        own = [str(o) for o in _recorded(recorded)]
        paths = _resolved_paths(run_dir)
    except Refused as e:
        _refuse(str(e))
    kept = [o for o in own if _key(o) not in PATH_KEYS and not _key(o).startswith("hydra.")]
    return [*kept, *paths, *args[1:], *_where(run_dir, kept)]


def _recorded(path: Path) -> list[str]:
    """The overrides Hydra recorded for the run: a list of strings, or DamagedFile."""
    own = read_yaml(path) or []
    if not isinstance(own, list) or not all(isinstance(o, str) for o in own):
        raise DamagedFile(f"{path}: not Hydra's record of overrides (a YAML list of "
                          "strings); restore it")
    return own


def quoted(value: str) -> str:
    """`value` as a quoted string of Hydra's override grammar, so a path holding a comma,
    `=`, a space, brackets or quotes is one value (a quote, and backslashes before one,
    escaped as the grammar asks)."""
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body) + "'"


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def _resolved_paths(run_dir: Path) -> list[str]:
    """model.path and data.path as the run resolved them (absolute), where it has them."""
    record = read_json(run_dir / "run.json")
    if record is None:
        return []
    config = record.get("config") if isinstance(record, dict) else None
    if not isinstance(config, dict):
        raise DamagedFile(f"{run_dir / 'run.json'}: holds no run config; restore it")
    return [f"{key}={quoted(str(value))}" for key in PATH_KEYS
            if (value := (config.get(key.split(".")[0]) or {}).get("path"))]


def _where(run_dir: Path, overrides: list[str]) -> list[str]:
    """The run's own directory: a run, or a one-job sweep where it was submitted."""
    submitted = any(_key(o) == "cluster" and not o.endswith("=basic") for o in overrides)
    if submitted:
        return [f"hydra.sweep.dir={quoted(str(run_dir.parent))}",
                f"hydra.sweep.subdir={quoted(run_dir.name)}"]
    return [f"hydra.run.dir={quoted(str(run_dir))}"]


def _refuse(line: str) -> None:
    print(line, file=sys.stderr)
    sys.exit(EXIT_BAD_CONFIG)

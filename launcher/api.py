"""pdecomp from Python: compose a run as the CLI does, run it, open what it wrote.

    from launcher import api
    cfg = api.compose(["optim.steps=200"], preset="tms_5-2")
    summary = api.run(cfg, "runs/tms")
    run = api.load_run("runs/tms")  # config, target, components, CI function, history

Composing needs Hydra, so it lives here, on the launcher side; `load_run` is the library's
(`pdecomp.run.load`), which never imports Hydra.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher import app
from pdecomp.core.config import ConfigError, RunConfig
from pdecomp.run.load import LoadedRun, RunDirError, load_run

__all__ = ["ComposeError", "LoadedRun", "RunDirError", "compose", "load_run", "run"]


class ComposeError(ConfigError):
    """A config Hydra or OmegaConf refused while composing (an unknown group option, a key
    the schema lacks, a value of the wrong type); `str()` is the CLI's one line."""

    def __init__(self, line: str):
        ValueError.__init__(self, line)  # already the whole message: no key=value to format
        self.key, self.value, self.allowed = None, None, line


def compose(overrides: Sequence[str] = (), preset: str | None = None) -> RunConfig:
    """The RunConfig `pdecomp [+experiment=<preset>] <overrides>` would run: the same
    defaults, the same checks, the same one-line errors (ConfigError). One run: a sweep
    value (`a=1,2`) is refused."""
    lines = [*([f"+experiment={preset}"] if preset else []), *overrides]
    try:
        for o in app.parse_overrides(lines):
            if o.is_sweep_override():
                raise ConfigError(o.get_key_element(), o.input_line.partition("=")[2],
                                  "compose makes one run; compose each value of a sweep")
        with app.conf_dir():
            cfg = app.compose_run(lines).cfg
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - Hydra's and OmegaConf's compose-time errors
        raise ComposeError(app.error_line(e)) from None
    return cfg


def run(cfg: RunConfig, run_dir: str | Path, hooks: Any = None) -> dict[str, Any]:
    """Run (or resume) `cfg` in `run_dir` in this process; the summary. `hooks`: a
    `pdecomp.run.decompose.Hooks` (progress, metrics, log) or None for plain printed lines."""
    from pdecomp.run.decompose import decompose  # jax only once a run starts

    return decompose(cfg, run_dir, hooks)

"""How a job of a sweep ended, and the one exit code of the sweep.

Every job of a `-m` sweep runs, whatever the others do. A job that does not finish leaves
`outcome.json` in its directory (its exit code and a one-line reason), written by the job
itself or, for a SLURM job that died without a word, by the launcher that waited for it.
The sweep's summary shows each failed job with its code and reason, and `pdecomp` exits with
the sweep's worst code, the same for every launcher.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdecomp.core.exits import EXIT_BAD_CONFIG, EXIT_GATE_REFUSED
from pdecomp.core.storage import read_json, write_text

FILE = "outcome.json"


def write(job_dir: Path, exit_code: int, reason: str) -> dict[str, Any]:
    ended = {"exit_code": exit_code, "reason": " ".join(reason.split())}  # one line
    write_text(job_dir / FILE, json.dumps(ended))  # whole or not at all
    return ended


def read(job_dir: Path) -> dict[str, Any] | None:
    return read_json(job_dir / FILE)


def worst(codes: list[int]) -> int:
    """The sweep's code: 3 if any gate refused, else 2 if any config was refused, else the
    first failure's code, else 0."""
    failed = [c for c in codes if c]
    for code in (EXIT_GATE_REFUSED, EXIT_BAD_CONFIG):
        if code in failed:
            return code
    return failed[0] if failed else 0

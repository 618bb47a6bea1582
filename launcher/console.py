"""The console results are printed on.

On a terminal rich fits tables to its width. Written to a file or a pipe (a SLURM log,
`pdecomp ... > log`), rich would assume 80 columns and fold every header and value into
slivers; there each table is as wide as it needs instead.
"""

from __future__ import annotations

from rich.console import Console

UNBOUNDED = 10_000  # columns: wider than any table pdecomp prints


def make_console(stderr: bool = False) -> Console:
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=UNBOUNDED)

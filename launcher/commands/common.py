"""What the library's own subcommands (`pdecomp analyze`, `convert`, `tokenize`) share: an
argument parser whose refusals are one line and exit 2, and a progress bar."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from pdecomp.core.exits import EXIT_BAD_CONFIG


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (`prog: what is wrong`) and exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)


def refuse(prog: str, line: str) -> int:
    """Print `prog: line` to stderr; the exit code of a refused input."""
    print(f"{prog}: {line}", file=sys.stderr)
    return EXIT_BAD_CONFIG


def progress_bar(total: int | None, label: str) -> tuple[Callable[[int, int], None],
                                                 Callable[[], None]]:
    """A rich progress bar on a terminal; nothing on a pipe or a file."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                   disable=not sys.stderr.isatty())
    task = bar.add_task(label, total=total)
    bar.start()
    return (lambda done, _: bar.update(task, completed=done)), bar.stop

"""How a `pdecomp` process ends: every exit code it gives, in one place (docs/cli.md's table
reads from these). Anything else is a crash, with its traceback."""

from __future__ import annotations

import signal

EXIT_DONE = 0
# A fault of the machine, not of the run's settings, said in one line: a write the file
# system refused (the last complete checkpoint is intact) or a loss gone non-finite.
EXIT_FAULT = 1
EXIT_BAD_CONFIG = 2  # refused for its config: one line naming the key, nothing written
EXIT_GATE_REFUSED = 3  # the memory gate refused the run: over the cap, with the report
EXIT_REQUEUED = 75  # a SLURM rank that checkpointed for a requeue (EX_TEMPFAIL)
# Stopped by a signal at a step boundary, with a checkpoint: 128 + its number, as a shell says.
EXIT_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C: 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143

EXIT_CODES = {EXIT_DONE: "done", EXIT_FAULT: "a write failed, or the loss went non-finite",
              EXIT_BAD_CONFIG: "bad config", EXIT_GATE_REFUSED: "the memory gate refused the run",
              EXIT_REQUEUED: "checkpointed for a requeue (a SLURM rank)",
              EXIT_INTERRUPTED: "stopped by Ctrl-C, with a checkpoint",
              EXIT_TERMINATED: "stopped by SIGTERM, with a checkpoint"}


class Refused(ValueError):
    """An input a command refuses (a bad value, a damaged or disagreeing file): `str()` is
    the one line naming it and what is allowed. Every command ends on one with exit 2."""

"""The multi-host helpers: who writes, and the agreements every process of a job reaches.

Each is a no-op (or its local answer) in a one-process run; the collectives must be called
by every process of the job, in the same order.
"""

from __future__ import annotations

import jax
import numpy as np


def is_main_process() -> bool:
    """Rank 0 alone writes the run directory's files; every rank writes checkpoint shards."""
    return jax.process_index() == 0


def gather(flags: np.ndarray) -> np.ndarray:
    """Every process's `flags`, concatenated in process order (a collective)."""
    flags = np.atleast_1d(flags)
    if jax.process_count() == 1:
        return flags
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(flags)).reshape(-1)


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is True on any (a collective)."""
    return bool(gather(np.int32(flag)).max())


def barrier(name: str) -> None:
    """Wait until every process of the job has reached `name` (a collective)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)

"""An analysis pass that can stop and go on: what its batches have gathered so far, saved
beside the run (`<run_dir>/.analysis-partial/`) and read back by the next `pdecomp analyze`
with the same request, which then skips the batches already read.

The host's part (each site's harvest, the windows read) is one pickle; the co-firing
counts, which live split over the devices and can be far larger than a host's memory (the
8B's are [147,456 x 147,456] per layer), are saved shard by shard, each device's rows in a
file of its own, and placed back onto the same shardings. Written into a temporary folder
and renamed over the last one: a stop while saving leaves the previous state whole.
"""

from __future__ import annotations

import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jaxtyping import Array

from pdecomp import storage

PARTIAL = ".analysis-partial"


@dataclass
class PassState:
    """What a pass has gathered after `batches` batches (`rows` windows or inputs)."""

    request: dict[str, Any]  # what was asked: a state is only resumed for the same request
    batches: int
    rows: int
    sites: dict[str, Any]  # site -> harvest.SiteHarvest
    tokens: list[np.ndarray]  # the windows read (language models)


def save(run_dir: Path, state: PassState, cofire: tuple[Array, ...]) -> None:
    """Write `state` and the co-firing counts (each device's shard apart) as the run's
    partial analysis, replacing the one before."""

    def files(tmp: Path) -> None:
        with open(tmp / "pass.pkl", "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        for g, counts in enumerate(cofire):
            for shard in counts.addressable_shards:
                np.save(tmp / f"cofire{g}_{shard.device.id}.npy", np.asarray(shard.data))

    storage.write_dir(run_dir / PARTIAL, files)


def load(run_dir: Path, request: dict[str, Any], like: tuple[Array, ...]
         ) -> tuple[PassState, tuple[Array, ...]] | None:
    """The partial analysis saved for `request`, with its co-firing counts placed as
    `like`; None when there is none or it was made for another request."""
    path = run_dir / PARTIAL / "pass.pkl"
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        state: PassState = pickle.load(f)
    if state.request != request:
        return None
    cofire = []
    for g, counts in enumerate(like):
        shards = [jax.device_put(np.load(run_dir / PARTIAL / f"cofire{g}_{s.device.id}.npy"),
                                 s.device) for s in counts.addressable_shards]
        cofire.append(jax.make_array_from_single_device_arrays(counts.shape, counts.sharding,
                                                               shards))
    return state, tuple(cofire)


def clear(run_dir: Path) -> None:
    shutil.rmtree(run_dir / PARTIAL, ignore_errors=True)

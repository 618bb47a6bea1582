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

import json
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jaxtyping import Array

from pdecomp.core import storage

PARTIAL = ".analysis-partial"
LAYOUT = "layout.json"  # where each saved shard lies in its whole array


@dataclass
class PassState:
    """What a pass has gathered after `batches` batches (`rows` windows or inputs)."""

    request: dict[str, Any]  # what was asked: a state is only resumed for the same request
    batches: int
    rows: int
    sites: dict[str, Any]  # site -> harvest.SiteHarvest
    tokens: list[np.ndarray]  # the windows read (language models)


def save(run_dir: Path, state: PassState, cofire: tuple[Array, ...]) -> None:
    """Write `state` and the co-firing counts (each device's shard apart, with where it
    lies in the whole) as the run's partial analysis, replacing the one before."""

    def files(tmp: Path) -> None:
        with open(tmp / "pass.pkl", "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        layout = []
        for g, counts in enumerate(cofire):
            pieces = []
            for k, shard in enumerate(counts.addressable_shards):
                np.save(tmp / f"cofire{g}_{k}.npy", np.asarray(shard.data))
                pieces.append(_bounds(shard.index, counts.shape))
            layout.append(pieces)
        (tmp / LAYOUT).write_text(json.dumps(layout))

    storage.write_dir(run_dir / PARTIAL, files)


# Where the classes of a partial analysis saved before the library became floors now live.
MOVED = {"pdecomp.analysis_state": "pdecomp.analysis.state",
         "pdecomp.harvest": "pdecomp.analysis.harvest"}


class OlderLayoutUnpickler(pickle.Unpickler):
    """Reads a partial analysis saved by this version or by one before the move."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED.get(module, module), name)


def load(run_dir: Path, request: dict[str, Any], like: tuple[Array, ...]
         ) -> tuple[PassState, tuple[Array, ...]] | None:
    """The partial analysis saved for `request`, with its co-firing counts placed as
    `like` (on any number of devices: each shard is cut from the saved pieces it overlaps);
    None when there is none or it was made for another request. DamagedFile, naming the
    file, when it cannot be read."""
    path = run_dir / PARTIAL / "pass.pkl"
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            state: PassState = OlderLayoutUnpickler(f).load()
        if not isinstance(state, PassState):
            raise TypeError(type(state).__name__)
        if state.request != request:
            return None
        layout = json.loads((run_dir / PARTIAL / LAYOUT).read_text())
        return state, tuple(_placed(run_dir / PARTIAL, g, layout[g], counts)
                            for g, counts in enumerate(like))
    except (OSError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            pickle.UnpicklingError) as e:
        raise storage.DamagedFile(
            f"{run_dir / PARTIAL}: the saved partial analysis cannot be read ({e or type(e)});"
            f" remove {PARTIAL} to start the analysis over") from None


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    """[[start, stop] per axis] of a shard's `index` in an array of `shape`."""
    return [list(sl.indices(n)[:2]) for sl, n in zip(index, shape, strict=True)]


def _placed(folder: Path, g: int, pieces: list[list[list[int]]], like: Array) -> Array:
    """Group `g`'s counts as `like` is placed: each of its shards filled from the saved
    pieces it overlaps (read through a memory map: only the overlap is read)."""
    shards = []
    for shard in like.addressable_shards:
        want = _bounds(shard.index, like.shape)
        out = np.zeros([b - a for a, b in want], like.dtype)
        filled = 0
        for k, have in enumerate(pieces):
            lo = [max(a, c) for (a, _), (c, _) in zip(want, have, strict=True)]
            hi = [min(b, d) for (_, b), (_, d) in zip(want, have, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            piece = np.load(folder / f"cofire{g}_{k}.npy", mmap_mode="r")
            src = tuple(slice(a - c, b - c) for a, b, (c, _) in zip(lo, hi, have, strict=True))
            dst = tuple(slice(a - c, b - c) for a, b, (c, _) in zip(lo, hi, want, strict=True))
            out[dst] = piece[src]
            filled += int(np.prod([b - a for a, b in zip(lo, hi, strict=True)]))
        if filled != out.size:
            raise ValueError(f"group {g}'s saved counts do not cover {want}")
        shards.append(jax.device_put(out, shard.device))
    return jax.make_array_from_single_device_arrays(like.shape, like.sharding, shards)


def clear(run_dir: Path) -> None:
    shutil.rmtree(run_dir / PARTIAL, ignore_errors=True)

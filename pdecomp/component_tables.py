"""Each site's components as a table anyone can read (pandas, pyarrow, DuckDB): one
Parquet file per site, one row per component, beside the report.

The firing frequency carries its sample size and an upper 95% bound (Wilson's score
interval), so a component that never fired is "dead at most this often" rather than dead:
with n positions analysed and none firing, the bound is about 3.8 / n.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

Z95 = 1.959964  # the two-sided 95% normal quantile


def wilson_upper(fired: np.ndarray, n: int, z: float = Z95) -> np.ndarray:
    """The upper end of Wilson's score interval for `fired` successes of `n` trials."""
    p = fired / n
    centre = p + z * z / (2 * n)
    spread = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return np.minimum((centre + spread) / (1 + z * z / n), 1.0)


def site_table(freq: np.ndarray, mean_ci: np.ndarray, max_ci: np.ndarray, norm: np.ndarray,
               positions: int, contexts: Sequence[Sequence[tuple[float, str]]] | None
               ) -> pa.Table:
    """One row per component: how often it fires (and the bound), its CI, its weight's
    norm and, for a language model, its top contexts (text, the firing token in [[ ]])
    with their CI."""
    fired = np.rint(freq * positions).astype(np.int64)
    columns = {
        "component": np.arange(len(freq), dtype=np.int32),
        "fired": fired,
        "positions": np.full(len(freq), positions, np.int64),
        "frequency": freq.astype(np.float64),
        "frequency_upper95": wilson_upper(fired, positions),
        "mean_ci": mean_ci.astype(np.float64),
        "max_ci": max_ci.astype(np.float64),
        "norm": norm.astype(np.float64),
        "dead": fired == 0,
    }
    if contexts is not None:
        columns["top_context"] = pa.array([[t for _, t in c] for c in contexts],
                                          pa.list_(pa.string()))
        columns["top_ci"] = pa.array([[v for v, _ in c] for c in contexts],
                                     pa.list_(pa.float64()))
    return pa.table(columns)


def file_name(site: str) -> str:
    """A site's file: its name with what a path cannot hold replaced (layers.3.mlp.up_proj
    stays as it is)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", site) + ".parquet"


def write(tables: dict[str, pa.Table], out: Path) -> list[Path]:
    """Each site's table as `out/<site>.parquet`, with the site named in its metadata."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for site, table in tables.items():
        path = out / file_name(site)
        pq.write_table(table.replace_schema_metadata({"site": site}), path)
        paths.append(path)
    return paths

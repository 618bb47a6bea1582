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


TOKEN = pa.struct([("token", pa.string()), ("id", pa.int64()), ("count", pa.int64()),
                   ("precision", pa.float64()), ("recall", pa.float64()), ("pmi", pa.float64())])
PARTNER = pa.struct([("site", pa.string()), ("component", pa.int64()), ("p", pa.float64())])
EFFECT = pa.struct([("token", pa.string()), ("id", pa.int64()), ("logit", pa.float64())])
CONTEXT = pa.struct([("text", pa.string()), ("ci", pa.float64()), ("act", pa.float64())])


def site_table(freq: np.ndarray, mean_ci: np.ndarray, max_ci: np.ndarray, norm: np.ndarray,
               positions: int, hist: np.ndarray, extra: dict[str, pa.Array] | None = None
               ) -> pa.Table:
    """One row per component: how often it fires (and the bound), its CI (and their
    histogram, `ci_hist`), its weight's norm, and the `extra` columns (lists per component:
    contexts, tokens, co-firing partners)."""
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
        "ci_hist": pa.array(list(hist.astype(np.int64)), pa.list_(pa.int64())),
        **(extra or {}),
    }
    return pa.table(columns)


def file_name(site: str) -> str:
    """A site's file: its name with what a path cannot hold replaced (layers.3.mlp.up_proj
    stays as it is)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", site) + ".parquet"


def write(tables: dict[str, pa.Table], out: Path, hist_edges: Sequence[float]
          ) -> list[Path]:
    """Each site's table as `out/<site>.parquet`, with the site and the CI histogram's bin
    edges in its metadata."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    edges = ",".join(repr(float(e)) for e in hist_edges)
    for site, table in tables.items():
        path = out / file_name(site)
        pq.write_table(table.replace_schema_metadata({"site": site, "ci_hist_edges": edges}),
                       path)
        paths.append(path)
    return paths

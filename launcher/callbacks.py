"""Hydra callbacks: the one summary table a `-m` sweep ends with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

# The result columns shown when present in a run's summary.json, in this order.
RESULT_PREFIXES = ("live/", "mmcs/", "ml2r/", "one_to_one/", "loss/total")


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per run of the sweep: its overrides and its summary (or gate report)."""
    rows = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                          key=lambda p: int(p.name)):
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_file.read_text()) if overrides_file.exists() else []
        row: dict[str, Any] = {"job": int(job_dir.name), "overrides": overrides}
        for name in ("summary.json", "gate.json"):
            f = job_dir / name
            if f.exists():
                row[name] = json.loads(f.read_text())
        rows.append(row)
    return rows


def sweep_table(rows: list[dict[str, Any]]) -> Table:
    # columns for the overrides whose value differs between jobs (the swept ones)
    values_of: dict[str, set[str]] = {}
    for r in rows:
        for o in r["overrides"]:
            k, _, v = o.partition("=")
            values_of.setdefault(k, set()).add(v)
    swept = sorted(k for k, vs in values_of.items() if len(vs) > 1 or len(rows) == 1)
    keys: list[str] = []
    for r in rows:
        for k in r.get("summary.json", {}):
            if k.startswith(RESULT_PREFIXES) and k not in keys:
                keys.append(k)
    table = Table(title="sweep summary")
    for col in ("job", *swept, "peak GiB", "fits", *keys):
        table.add_column(col)
    for r in rows:
        values = dict(o.split("=", 1) for o in r["overrides"])
        gate = r.get("gate.json", {})
        summary = r.get("summary.json", {})
        cells = [str(r["job"]), *(values.get(k, "") for k in swept),
                 f"{gate['peak_bytes'] / 2**30:.4f}" if gate else "-",
                 ("yes" if gate.get("fits") else "NO") if gate else "-"]
        for k in keys:
            v = summary.get(k)
            cells.append("-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
        table.add_row(*cells)
    return table


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.exists():
            return
        rows = collect(sweep_dir)
        (sweep_dir / "sweep_summary.json").write_text(json.dumps(rows, indent=1))
        Console().print(sweep_table(rows))

"""A sweep's memory summary: sweep_summary.csv and sweep_memory.png from the jobs' gate reports.

The unit test builds a sweep directory by hand and runs the end-of-sweep callback on it; the
slow journey runs a real `pdecomp -m gate.only=true` sweep over batch sizes.
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import PDECOMP
from omegaconf import OmegaConf

from launcher.callbacks import SweepSummary

GiB = 2**30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def gate_report(argument: float, temp: float, output: float, alias: float, cap: float
                ) -> dict[str, Any]:
    """A gate.json as pdecomp.gate.compiled writes it, sizes given in GiB."""
    peak = temp + argument + output - alias
    sizes = {"argument": argument, "output": output, "temp": temp, "alias": alias,
             "host_temp": 0.0, "peak": peak, "xla_peak": 0.9 * peak, "cap": cap,
             "headroom": cap - peak}
    return {"target": "h100 x 8", "mesh": {"data": 8}, "n_devices": 8,
            **{f"{k}_bytes": int(v * GiB) for k, v in sizes.items()},
            "cap_source": "memory.hbm_cap_gib", "fits": peak <= cap, "compile_s": 1.5,
            "argument_parts_bytes": {}}


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_end_writes_memory_csv_and_plot(tmp_path: Path) -> None:
    reports = [gate_report(2.0, 10.0, 1.0, 0.5, 64.0), gate_report(2.0, 40.0, 1.0, 0.5, 64.0),
               gate_report(2.0, 80.0, 1.0, 0.5, 64.0)]
    for job, (batch, report) in enumerate(zip((256, 1024, 4096), reports)):
        hydra_dir = tmp_path / str(job) / ".hydra"
        hydra_dir.mkdir(parents=True)
        (hydra_dir / "overrides.yaml").write_text(
            yaml.safe_dump(["gate.only=true", f"data.batch_size={batch}"]))
        (tmp_path / str(job) / "gate.json").write_text(json.dumps(report))

    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))

    rows = read_csv(tmp_path / "sweep_summary.csv")
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    assert [r["data.batch_size"] for r in rows] == ["256", "1024", "4096"]
    assert "gate.only" not in rows[0]  # the same in every job: not a swept column
    assert [float(r["peak_gib"]) for r in rows] == [12.5, 42.5, 82.5]
    assert [float(r["temp_gib"]) for r in rows] == [10.0, 40.0, 80.0]
    assert float(rows[0]["argument_gib"]) == 2.0 and float(rows[0]["alias_gib"]) == 0.5
    assert float(rows[2]["headroom_gib"]) == -18.5 and float(rows[2]["cap_gib"]) == 64.0
    assert [r["fits"] for r in rows] == ["True", "True", "False"]
    assert rows[0]["target"] == "h100 x 8" and rows[0]["n_devices"] == "8"
    assert rows[0]["compile_s"] == "1.5"

    png = tmp_path / "sweep_memory.png"
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_csv_leaves_missing_values_blank(tmp_path: Path) -> None:
    """A job that never reached the gate has no gate.json: its row still lists it, blank."""
    for job, lr in enumerate(("0.001", "0.01")):
        (tmp_path / str(job) / ".hydra").mkdir(parents=True)
        (tmp_path / str(job) / ".hydra" / "overrides.yaml").write_text(
            yaml.safe_dump([f"optim.components.lr={lr}"]))
    (tmp_path / "1" / "summary.json").write_text(json.dumps({"loss/total": 0.25, "steps": 5}))

    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))

    rows = read_csv(tmp_path / "sweep_summary.csv")
    assert [r["optim.components.lr"] for r in rows] == ["0.001", "0.01"]
    assert rows[0]["peak_gib"] == rows[0]["loss/total"] == ""
    assert float(rows[1]["loss/total"]) == 0.25 and "steps" not in rows[1]
    assert not (tmp_path / "sweep_memory.png").exists()  # no gate report, nothing to plot


@pytest.mark.slow
def test_gate_only_sweep_over_batch_size(env: dict[str, str], tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [PDECOMP, "-m", "gate.only=true", "data.batch_size=256,1024,4096",
         f"hydra.sweep.dir={sweep_dir}"],
        check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]

    csv_path, png = sweep_dir / "sweep_summary.csv", sweep_dir / "sweep_memory.png"
    rows = read_csv(csv_path)
    assert [int(r["data.batch_size"]) for r in rows] == [256, 1024, 4096]
    peaks = [float(r["peak_gib"]) for r in rows]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1], peaks
    assert all(r["fits"] == "True" for r in rows)
    # each job's forecast in the CSV, and the table's rank by it (1: the fastest step)
    seconds = [float(r["forecast_s"]) for r in rows]
    assert all(s > 0 for s in seconds)
    assert "forecast" in proc.stdout and "rank" in proc.stdout
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"sweep csv: {csv_path}" in proc.stdout
    assert f"memory plot: {png}" in proc.stdout

"""Hydra callbacks: what a `-m` sweep ends with: one summary table (failed jobs with their
exit code and reason), its JSON and CSV, a plot of each job's gate report (per-device memory
against the cap), and the sweep's exit code."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.table import Table

from launcher import outcome, slurm_jobs
from launcher.console import make_console
from pdecomp.core.storage import DamagedFile, read_json, read_yaml
from pdecomp.core.units import GiB
from pdecomp.spd.plots import plot_gate_sweep

# The result columns shown when present in a run's summary.json, in this order.
RESULT_PREFIXES = ("live/", "mmcs/", "ml2r/", "one_to_one/", "kl/", "ce_unrecovered/",
                   "loss/total")

# gate.json sizes written to the CSV in GiB (`<name>_bytes` -> `<name>_gib`), then other fields.
GATE_SIZES = ("argument", "output", "temp", "alias", "host_temp", "host_argument", "peak",
              "xla_peak", "cap", "headroom")
GATE_FIELDS = ("fits", "compile_s", "target", "n_devices", "batch_size")

# What `pdecomp` exits with after a sweep (outcome.worst of its jobs); set at the sweep's end.
sweep_result = {"exit_code": 0}


def job_dirs(sweep_dir: Path) -> dict[int, Path]:
    """Each job's directory by job number, wherever `hydra.sweep.subdir` put it (the job
    number by default; `${hydra.job.override_dirname}` and the like too): a directory
    holding Hydra's `.hydra/`, numbered by its `hydra.yaml`'s `hydra.job.num` (or, where
    that is missing, by its own name when that is a number)."""
    found: dict[int, Path] = {}
    for root, dirs, _ in os.walk(sweep_dir):
        if ".hydra" in dirs and Path(root) != sweep_dir:
            hydra_yaml = Path(root) / ".hydra" / "hydra.yaml"
            record = read_yaml(hydra_yaml) if hydra_yaml.is_file() else None
            num = ((record or {}).get("hydra") or {}).get("job", {}).get("num") \
                if isinstance(record, dict) else None
            if not isinstance(num, int) and Path(root).name.isdigit():
                num = int(Path(root).name)
            if isinstance(num, int):
                found[num] = Path(root)
            dirs.clear()  # a job's own directory holds no other job
        else:
            dirs[:] = [d for d in dirs if not d.startswith(".")]  # .submitit, .code
    return dict(sorted(found.items()))


def collect(sweep_dir: Path, extra: dict[int, Path] | None = None) -> list[dict[str, Any]]:
    """One row per job of the sweep: its overrides and its summary (or gate report), from
    its directory; `extra` adds the directories of jobs that may not have made theirs."""
    rows = []
    for num, job_dir in sorted({**(extra or {}), **job_dirs(sweep_dir)}.items()):
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        overrides = (read_yaml(overrides_file) or []) if overrides_file.exists() else []
        if not isinstance(overrides, list):
            raise DamagedFile(f"{overrides_file}: not Hydra's record of overrides (a YAML "
                              "list of strings); restore it")
        row: dict[str, Any] = {"job": num, "overrides": overrides, "dir": str(job_dir)}
        for name in ("summary.json", "gate.json"):
            if (record := read_json(job_dir / name)) is not None:
                row[name] = record
        if ended := outcome.read(job_dir):
            row["outcome"] = ended
        rows.append(row)
    return rows


def override_values(row: dict[str, Any]) -> dict[str, str]:
    """A job's overrides as key -> value (`~key` deletions have an empty value)."""
    values = {}
    for o in row["overrides"]:
        k, _, v = o.partition("=")
        values[k] = v
    return values


def swept_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The override keys whose value differs between jobs; all of them for a one-job sweep."""
    values_of: dict[str, set[str]] = {}
    for r in rows:
        for k, v in override_values(r).items():
            values_of.setdefault(k, set()).add(v)
    return sorted(k for k, vs in values_of.items() if len(vs) > 1 or len(rows) == 1)


def result_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The summary.json keys shown as results, in the order they are first seen."""
    keys: list[str] = []
    for r in rows:
        for k in r.get("summary.json", {}):
            if k.startswith(RESULT_PREFIXES) and k not in keys:
                keys.append(k)
    return keys


def job_label(row: dict[str, Any], swept: list[str]) -> str:
    """What tells this job apart: its swept `key=value`s, one a line, else its number."""
    values = override_values(row)
    return "\n".join(f"{k}={values[k]}" for k in swept if k in values) or str(row["job"])


def job_table(row: dict[str, Any]) -> Table:
    """A sweep of one job (a run submitted to a cluster): its results, one per line."""
    gate, summary = row.get("gate.json", {}), row.get("summary.json", {})
    table = Table(title=f"job {row['job']}", show_header=False)
    table.add_row("overrides", " ".join(row["overrides"]))
    if state := row.get("state"):
        table.add_row("state", state)
    if ended := row.get("outcome"):
        table.add_row("exit", str(ended["exit_code"]))
        table.add_row("why", ended["reason"])
    if gate:
        table.add_row("peak GiB (per device)", f"{gate['peak_bytes'] / GiB:.4f}")
        table.add_row("fits", "yes" if gate.get("fits") else "NO")
    for k in result_keys([row]):
        v = summary[k]
        table.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    return table


def sweep_table(rows: list[dict[str, Any]]) -> Table:
    if len(rows) == 1:
        return job_table(rows[0])
    swept, keys = swept_keys(rows), result_keys(rows)
    failures = any("outcome" in r for r in rows)
    unsettled = any("state" in r for r in rows)
    table = Table(title="sweep summary")
    seconds = [forecast_s(r.get("gate.json", {})) for r in rows]
    ranked = sorted(s for s in seconds if s is not None)
    for col in ("job", *swept, *(("state",) if unsettled else ()),
                *(("exit", "why") if failures else ()), "peak GiB", "temp GiB",
                "arg GiB", "fits", *(("s/step (forecast)", "rank") if ranked else ()), *keys):
        table.add_column(col)
    for r, sec in zip(rows, seconds, strict=True):
        values = override_values(r)
        gate = r.get("gate.json", {})
        summary = r.get("summary.json", {})
        sizes = [f"{gate[f'{k}_bytes'] / GiB:.4f}" if gate else "-"
                 for k in ("peak", "temp", "argument")]
        ended = r.get("outcome", {"exit_code": 0, "reason": ""})
        status = [str(ended["exit_code"]), ended["reason"]] if failures else []
        state = [r.get("state", "ended")] if unsettled else []
        cells = [str(r["job"]), *(values.get(k, "") for k in swept), *state, *status, *sizes,
                 ("yes" if gate.get("fits") else "NO") if gate else "-"]
        if ranked:  # 1: the fastest step the gates forecast
            cells += ["-", "-"] if sec is None else [f"{sec:.4g}", str(ranked.index(sec) + 1)]
        for k in keys:
            v = summary.get(k)
            cells.append("-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
        table.add_row(*cells)
    return table


def forecast_s(gate: dict[str, Any]) -> float | None:
    """A gate's forecast seconds a step (None: no forecast made)."""
    return ((gate.get("step") or {}).get("forecast") or {}).get("s_per_step")


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    """One row per job: swept overrides, gate report (sizes in GiB), results; blank if absent."""
    swept, keys = swept_keys(rows), result_keys(rows)
    fields = ["job", *swept, "exit_code", "reason", *(f"{k}_gib" for k in GATE_SIZES),
              *GATE_FIELDS, "forecast_s", *keys]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        for r in rows:
            gate, summary = r.get("gate.json", {}), r.get("summary.json", {})
            values = override_values(r)
            writer.writerow({
                "job": r["job"],
                **{k: values[k] for k in swept if k in values},
                **r.get("outcome", {"exit_code": 0}),
                **{f"{k}_gib": round(gate[f"{k}_bytes"] / GiB, 4)
                   for k in GATE_SIZES if gate.get(f"{k}_bytes") is not None},
                **{k: gate[k] for k in GATE_FIELDS if k in gate},
                **({"forecast_s": forecast_s(gate)} if forecast_s(gate) is not None else {}),
                **{k: summary[k] for k in keys if k in summary},
            })
    return path


def report(sweep_dir: Path, rows: list[dict[str, Any]]) -> int:
    """The sweep's summary: its table printed; JSON, CSV and memory plot written beside its
    jobs; the sweep's exit code (outcome.worst of the jobs that ended) returned."""
    code = outcome.worst([r.get("outcome", {"exit_code": 0})["exit_code"] for r in rows])
    (sweep_dir / "sweep_summary.json").write_text(json.dumps(rows, indent=1))
    console = make_console()
    console.print(sweep_table(rows))
    lines = [f"sweep csv: {write_csv(rows, sweep_dir / 'sweep_summary.csv')}"]
    gated = [r for r in rows if "gate.json" in r]
    if gated:
        swept = swept_keys(rows)
        png = plot_gate_sweep([job_label(r, swept) for r in gated],
                              [r["gate.json"] for r in gated], sweep_dir / "sweep_memory.png")
        lines.append(f"memory plot: {png}")
    failed = [r for r in rows if "outcome" in r]
    if failed:
        lines.append(f"{len(failed)} of {len(rows)} jobs failed; exit {code}")
    for line in lines:  # plain text on one line each, however long the path
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    return code


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.exists():
            return
        submitted = slurm_jobs.load(sweep_dir)
        if submitted and not submitted["waited"]:  # the jobs run on: say how to follow them
            slurm_jobs.say_submitted(sweep_dir, submitted, make_console())
            return
        extra = slurm_jobs.dirs(submitted) if submitted else None
        sweep_result["exit_code"] = report(sweep_dir, collect(sweep_dir, extra))

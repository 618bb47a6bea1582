"""A job's wandb run: the mode it runs in, the logger (one run per job, resumed by its id),
and an analysis report's plots and component tables logged to the run it analysed."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from pdecomp.core.config import RunConfig


def wandb_mode(cfg: RunConfig) -> str:
    """`logging.wandb.mode`, else $WANDB_MODE, else offline."""
    return cfg.logging.wandb.mode or os.environ.get("WANDB_MODE") or "offline"


class WandbLogger:
    """One wandb run per job, resumed by its id (`wandb_id.txt` in the run directory),
    named and grouped as `logging.wandb` and the job say; wandb's own environment and login
    (a self-hosted host, an entity) are the user's."""

    def __init__(self, cfg: RunConfig, run_dir: Path, config: dict[str, Any],
                 identity: dict[str, Any]):
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        w = cfg.logging.wandb
        self.run = wandb.init(project=w.project, entity=w.entity or None, id=run_id,
                              resume="allow", dir=str(run_dir), config=config,
                              mode=wandb_mode(cfg), job_type=w.job_type, **identity,
                              settings=wandb.Settings(console="wrap"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def summary(self, key: str, value: Any) -> None:
        self.run.summary[key] = value

    def artifact(self, kind: str, path: Path, by_reference: bool) -> None:
        """`path` as an artifact of this run: by reference (its location, nothing copied or
        read: a checkpoint of any size), or its files copied (a report)."""
        import wandb

        art = wandb.Artifact(f"{kind}-{self.run.id}", type=kind,
                             metadata={"path": str(path.resolve())})
        if by_reference:
            art.add_reference(path.resolve().as_uri(), checksum=False)
        else:
            art.add_dir(str(path))
        self.run.log_artifact(art)

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def log_report(run: Any, index: Path) -> None:
    """After `pdecomp analyze` on a run that logs to wandb: the report's plots, as images,
    in that run's wandb (resumed by its id; offline unless WANDB_MODE says otherwise)."""
    if wandb_mode(run.config) == "disabled":
        return
    import wandb
    import yaml

    config = yaml.safe_load((run.run_dir / "config.yaml").read_text())
    wb = WandbLogger(run.config, run.run_dir, config, {})
    wb.run.log({**{f"analyze/{p.stem}": wandb.Image(str(p))
                   for p in sorted(index.parent.glob("*.png"))},
                **analysis_tables(index.parent)})
    if run.config.logging.wandb.artifacts:
        wb.artifact("report", index.parent, by_reference=False)
    wb.finish()


def analysis_tables(report: Path) -> dict[str, Any]:
    """Each site's component table (`components/<site>.parquet` of the report) as a
    wandb.Table, its rows by firing frequency, at most the rows wandb takes in one log
    (wandb.Table.MAX_ROWS): the whole table is the Parquet file (and the report artifact).
    A list cell (the top contexts) is shown joined."""
    import pyarrow.parquet as pq
    import wandb

    tables = {}
    for path in sorted((report / "components").glob("*.parquet")):
        t = pq.read_table(path)
        site = (t.schema.metadata or {}).get(b"site", path.stem.encode()).decode()
        t = t.sort_by([("frequency", "descending")]).slice(0, wandb.Table.MAX_ROWS)
        rows = [[_cell(v) for v in r.values()] for r in t.to_pylist()]
        tables[f"analyze/components/{site}"] = wandb.Table(columns=t.column_names, data=rows)
    return tables


def _cell(value: Any) -> Any:
    """A list cell as one string: each entry by its name (a context's text, a token, a
    partner as site:component) with its first figure (CI, count, logit or probability)."""
    if not isinstance(value, list):
        return value

    def one(v: Any) -> str:
        if not isinstance(v, dict):
            return str(v)
        name = (v["text"] if "text" in v else repr(v["token"]) if "token" in v
                else f"{v.get('site')}:{v.get('component')}")
        figure = next((v[k] for k in ("ci", "count", "logit", "p") if k in v), None)
        if figure is None:
            return name
        return f"{name} ({figure:.3g})" if isinstance(figure, float) else f"{name} ({figure})"

    return " | ".join(one(v) for v in value)



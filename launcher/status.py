"""`pdecomp status <sweep dir> [--wait]`: a sweep's summary table, rebuilt from what its jobs
wrote: the table, JSON, CSV and memory plot a blocking run ends with. For jobs submitted to
SLURM (which `pdecomp cluster=slurm ...` leaves to run), those still queued or running are
shown with their state, and those that ended without a word get their reason from SLURM.
Exits with the sweep's code as it stands (outcome.worst of the jobs that ended)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from launcher import callbacks, slurm_jobs
from launcher.console import make_console
from pdecomp.core.exits import EXIT_BAD_CONFIG


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdecomp status", description=__doc__.split(":")[0])
    parser.add_argument("sweep_dir", type=Path, help="the sweep's directory (hydra.sweep.dir)")
    parser.add_argument("--wait", action="store_true",
                        help="wait until every job has ended, then print the summary")
    parser.add_argument("--every", type=float, default=30.0, metavar="SECONDS",
                        help="with --wait: how often to ask SLURM (default 30)")
    args = parser.parse_args(argv)
    if args.every <= 0:
        parser.error(f"--every {args.every}: give a number of seconds above 0")
    return args


def rows_now(sweep_dir: Path, submitted: dict[str, Any] | None
             ) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The sweep's rows as its jobs stand, and the SLURM state of those not ended yet."""
    if submitted is None:  # a sweep of another launcher: every job ended with it
        return callbacks.collect(sweep_dir), {}
    pending: dict[int, str] = {}
    entries = {e["num"]: e for e in submitted["jobs"]}
    for num, (job, state) in slurm_jobs.states(submitted).items():
        if slurm_jobs.unsettled(job, state):
            pending[num] = state
        else:
            slurm_jobs.settle(job, Path(entries[num]["dir"]), state)
    rows = callbacks.collect(sweep_dir, slurm_jobs.dirs(submitted))
    for row in rows:
        if row["job"] in pending:
            row["state"] = pending[row["job"]]
        if not row["overrides"] and row["job"] in entries:  # not started: what it was given
            row["overrides"] = entries[row["job"]]["overrides"]
    return rows, pending


def main(argv: list[str]) -> int:
    args = parse(argv)
    sweep_dir = args.sweep_dir.expanduser().absolute()
    submitted = slurm_jobs.load(sweep_dir) if sweep_dir.is_dir() else None
    if submitted is None and not (sweep_dir.is_dir() and callbacks.job_dirs(sweep_dir)):
        print(f"{sweep_dir}: not a sweep directory pdecomp made (no {slurm_jobs.FILE}, no "
              "job directories)", file=sys.stderr)
        return EXIT_BAD_CONFIG
    rows, pending = rows_now(sweep_dir, submitted)
    while pending and args.wait:
        time.sleep(args.every)
        rows, pending = rows_now(sweep_dir, submitted)
    code = callbacks.report(sweep_dir, rows)
    if pending:
        assert submitted is not None
        make_console().print(
            f"{len(pending)} of {len(rows)} jobs not ended yet (squeue -j "
            f"{','.join(slurm_jobs.job_ids(submitted))}); pdecomp status {sweep_dir} --wait "
            "waits for them", soft_wrap=True, markup=False, highlight=False)
    return code

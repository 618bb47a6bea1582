"""`pdecomp label <run_dir>`: each firing component of an analysed run labelled by a chat
API (pdecomp.analysis.labels)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq

from launcher.commands.common import Parser, progress_bar, refuse
from pdecomp.analysis.labels import FILE, PROG, KeyRefused, ask, label_all, read_labels, todo
from pdecomp.core import storage
from pdecomp.core.exits import EXIT_BAD_CONFIG


def parser() -> Parser:
    p = Parser(prog=PROG, description="Label each firing component of an analysed run with "
                                      "a language model (an OpenAI-compatible chat API).")
    p.add_argument("run_dir", help="a run directory analysed by `pdecomp analyze`")
    p.add_argument("--model", default="gpt-4o-mini", help="the API's model name")
    p.add_argument("--api-base", default="https://api.openai.com/v1",
                   help="an OpenAI-compatible API (default OpenAI's)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="the environment variable holding the key (default OPENAI_API_KEY)")
    p.add_argument("--limit", type=int, default=None,
                   help="at most this many components per site, the most frequent first")
    p.add_argument("--workers", type=int, default=8, help="requests in flight (default 8)")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    run_dir = Path(args.run_dir).absolute()
    key = os.environ.get(args.api_key_env, "")
    tables = sorted((run_dir / "analysis" / "components").glob("*.parquet"))
    unwritable = storage.unwritable(run_dir)
    for bad, line in (
            (not tables,
             f"{run_dir}: no analysis/components/*.parquet (run `pdecomp analyze` on it first)"),
            (tables and "top_contexts" not in pq.read_schema(tables[0]).names,
             f"{run_dir}: its analysis has no contexts to label from (a language model's has)"),
            (not key, (f"no key in ${args.api_key_env}: set it (or name another variable with "
                      "--api-key-env)")),
            (args.limit is not None and args.limit < 1, f"--limit={args.limit} must be >= 1"),
            (args.workers < 1, f"--workers={args.workers} must be >= 1"),
            (tables and unwritable,
             f"{run_dir}: {unwritable}; the labels are written in the run directory")):
        if bad:
            return refuse(PROG, line)
    jobs = list(todo(run_dir, args.limit, read_labels(run_dir)))
    update, stop = progress_bar(len(jobs), "components")
    try:
        n = label_all(run_dir, jobs, lambda p: ask(args.api_base, key, args.model, p),
                      args.workers, args.model, update)
    except KeyRefused as e:
        print(f"{PROG}: {e}; the labels so far are in {run_dir / FILE}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except ConnectionError as e:  # the same command goes on where this one stopped
        print(f"{PROG}: {e}; the labels so far are in {run_dir / FILE}", file=sys.stderr)
        return 1
    finally:
        stop()
    print(f"{n} labels written to {run_dir / FILE} ({len(read_labels(run_dir))} in all)")
    return 0

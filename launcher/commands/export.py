"""`pdecomp export <run_dir> [-o DIR]`: a finished run's components and CI function as
safetensors with a manifest (pdecomp.analysis.export)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from launcher.commands.common import Parser, refuse
from pdecomp.analysis.export import OUT_DIR, PROG, output_problem, write
from pdecomp.run.load import RunDirError, load_run


def parser() -> Parser:
    p = Parser(prog=PROG,
               description="Write a finished run's components (V, U per site) and CI "
                           "function as safetensors with a JSON manifest, readable "
                           "without pdecomp.")
    p.add_argument("run_dir", help="a run directory (config.yaml and checkpoints/)")
    p.add_argument("-o", "--output", help="the directory to write (default "
                                          "<run_dir>/export; replaced if it is an export)")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    out = Path(args.output) if args.output else Path(args.run_dir) / OUT_DIR
    if why := output_problem(out):
        return refuse(PROG, f"-o {out}: {why}; give a new or empty directory, or an earlier "
                            "export")
    try:
        loaded = load_run(args.run_dir, log=lambda line: print(line, file=sys.stderr),
                          whole_state=False)
    except RunDirError as e:
        return refuse(PROG, f"{e}; expects a run directory with config.yaml and checkpoints/")
    final = write(loaded, out.absolute())
    n = sum(c.V.shape[1] for c in loaded.components.sites.values())
    print(f"{len(loaded.components.sites)} sites, {n:,} components (step {loaded.step})",
          file=sys.stderr)
    print(final)
    return 0

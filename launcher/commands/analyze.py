"""`pdecomp analyze <run_dir>`: the analysis gate, then the pass over the run's data, then the
report in `<run_dir>/analysis/` (pdecomp.analysis.analyze)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from launcher.commands.common import Parser, progress_bar
from pdecomp.analysis import gate as analysis_gate
from pdecomp.analysis import state as analysis_state
from pdecomp.analysis.analyze import analyse, options, reads_tokens
from pdecomp.analysis.report import write_report
from pdecomp.core import hardware, storage
from pdecomp.core.exits import EXIT_BAD_CONFIG, EXIT_GATE_REFUSED
from pdecomp.core.units import fmt_bytes
from pdecomp.gate.step import GateRefused
from pdecomp.plan.resolve import resolve
from pdecomp.run.load import (
    LoadedRun,
    RunDirError,
    analysis_mesh,
    check_agrees,
    load_run,
    read_config,
)


def parser() -> Parser:
    p = Parser(
        prog="pdecomp analyze",
        description="Write a static HTML report on a finished run's components into "
                    "<run_dir>/analysis/ (index.html and the plots as PNGs).")
    p.add_argument("run_dir", help="a run directory (config.yaml and checkpoints/)")
    p.add_argument("--top-k", type=int, default=5,
                   help="language models: top activating contexts per component (default 5)")
    p.add_argument("--reservoir", type=int, default=5,
                   help="language models: firing contexts per component drawn uniformly "
                        "among all its firings (default 5)")
    p.add_argument("--no-cofire", action="store_true",
                   help="skip the co-firing counts within each layer ([sum C, sum C] per "
                        "layer, split over the devices)")
    p.add_argument("--tokens", type=int, default=1_000_000,
                   help="language models: token positions to analyse (default 1e6: a "
                        "component firing once in 1e5 positions is seen about 10 times)")
    p.add_argument("--no-ablation", action="store_true",
                   help="language models: skip the ablation effects (a backward pass through "
                        "the layers after the first site, per batch)")
    p.add_argument("--windows", type=int, default=None,
                   help="language models: windows of data.seq_len to analyse (instead of "
                        "--tokens)")
    p.add_argument("--split", choices=("held_out", "train"), default="held_out",
                   help="language models: the run's held-out windows (default) or its "
                        "training stream's (more distinct text where the held-out part is "
                        "small)")
    p.add_argument("--inputs", type=int, default=8192,
                   help="toys: sampled inputs to analyse (default 8192)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="windows or inputs per batch (default: the run's data.batch_size)")
    p.add_argument("--save-every", type=float, default=120.0,
                   help="seconds between saves of what the pass has gathered, beside the run "
                        "(.analysis-partial/): the same command run again goes on from the "
                        "last save (default 120; 0: after every batch)")
    p.add_argument("--devices", type=int, default=1,
                   help="analyse on this many local devices, the components and CI "
                        "function split along C over them (default 1)")
    p.add_argument("--target", default="local", choices=("local", *hardware.GPUS),
                   help="a GPU kind: gate the analysis on --devices of them from this host "
                        "(compile only; nothing is read or written): exit 0 if it fits, 3 "
                        "if not, the report as JSON on stdout (default local: analyse here)")
    p.add_argument("--gpus-per-host", type=int, default=8,
                   help="with --target: GPUs per host (default 8)")
    p.add_argument("--hbm-cap-gib", type=float, default=None,
                   help="per-device memory cap of the analysis gate (default: the run's "
                        "memory.hbm_cap_gib, else the devices' own)")
    return p


def _bad_flag(args: Any) -> str | None:
    """The first flag out of range, as its one line."""
    for name in ("top_k", "reservoir", "tokens", "windows", "inputs", "batch_size", "devices",
                 "gpus_per_host", "hbm_cap_gib", "save_every"):
        value = getattr(args, name)
        zero_ok = name in ("top_k", "reservoir", "save_every")
        if value is not None and value < (0 if zero_ok else 1e-9):
            floor = ">= 0" if zero_ok else "> 0"
            return f"pdecomp analyze: --{name.replace('_', '-')}={value} must be {floor}"
    if args.target != "local" and args.devices > args.gpus_per_host \
            and args.devices % args.gpus_per_host:
        return (f"pdecomp analyze: --devices={args.devices} must be a multiple of "
                f"--gpus-per-host={args.gpus_per_host} (whole hosts)")
    return None


def refusal(args: Any) -> str | None:
    """The one line that refuses these arguments before anything is compiled (a flag out of
    range, a run directory with nothing to read), or None."""
    if bad := _bad_flag(args):
        return bad
    run_dir = Path(args.run_dir).absolute()
    try:
        config = read_config(run_dir)
        if args.target == "local":
            check_agrees(resolve(config), run_dir)
    except RunDirError as e:
        return f"{e}; pdecomp analyze expects a run directory with config.yaml and checkpoints/"
    if args.target == "local" and (why := storage.unwritable(run_dir)):
        return f"pdecomp analyze: {run_dir}: {why}; the report is written in the run directory"
    if args.target == "local" and args.devices > len(jax.devices()):
        return (f"pdecomp analyze: --devices={args.devices}: this process has "
                f"{len(jax.devices())} (PDECOMP_CPU_DEVICES=N splits a CPU into N)")
    return None


def gated_run(args: Any, log: Callable[[str], None]
              ) -> tuple[LoadedRun | None, dict[str, Any]]:
    """The analysis gate on the mesh asked for, then (if it fits, and the mesh is this
    host's) the run's components and CI function read onto that mesh; GateRefused with the
    report. Deviceless (`--target`), no run is read: (None, report). After `refusal`."""
    run_dir = Path(args.run_dir).absolute()
    plan = resolve(read_config(run_dir))
    deviceless = args.target != "local"
    if deviceless:
        mesh = analysis_gate.target_mesh(args.target, args.devices, args.gpus_per_host)
    else:
        mesh = analysis_mesh(args.devices)
    report = analysis_gate.gate(plan, mesh, options(plan, args.top_k, args.reservoir,
                                                    not args.no_cofire, not args.no_ablation),
                                args.batch_size or plan.config.data.batch_size, args.hbm_cap_gib,
                                args.target if deviceless else None)
    if not report.fits:
        raise GateRefused(report)
    log(f"analysis gate: {fmt_bytes(report.peak_bytes)} per device of "
        f"{fmt_bytes(report.cap_bytes)} on {report.n_devices} device(s)")
    if deviceless:
        return None, report
    return load_run(run_dir, log=log, mesh=mesh, whole_state=False), report


def main(argv: Sequence[str],
         on_report: Callable[[LoadedRun, Path], None] | None = None) -> int:
    """`pdecomp analyze`; `on_report(run, index)` once the report is written (the launcher
    logs its plots to the run's wandb there: this library never imports wandb)."""
    args = parser().parse_args(argv)
    if bad := refusal(args):
        print(bad, file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        run, report = gated_run(args, lambda line: print(line, file=sys.stderr))
    except hardware.GpuCompileUnavailable as e:
        print(f"pdecomp analyze: --target={args.target}: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except GateRefused as e:
        if args.target != "local":
            print(json.dumps(e.report.to_json(), default=str))
        print(analysis_gate.refusal(e.report), file=sys.stderr)
        return EXIT_GATE_REFUSED
    if run is None:  # deviceless: the gate is the answer
        print(json.dumps(report.to_json(), default=str))
        return 0
    lm = reads_tokens(run.run)
    windows = args.windows or math.ceil(args.tokens / run.config.data.seq_len)
    total = windows if lm else args.inputs
    update, stop = progress_bar(total, f"{args.split} windows" if lm else "inputs")
    try:
        a = analyse(run, windows, args.inputs, args.top_k, args.batch_size, update,
                    args.reservoir, not args.no_cofire, args.split, not args.no_ablation,
                    args.save_every)
    finally:
        stop()
    index = write_report(a, run.run_dir, report.to_json())
    analysis_state.clear(run.run_dir)  # the report holds it all now
    if on_report:
        on_report(run, index)
    for s, v in a.stats.items():
        print(f"{s}: {len(v.freq) - v.dead} firing, {v.dead} dead of {len(v.freq)}",
              file=sys.stderr)
    print(index)
    return 0

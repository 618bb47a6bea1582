"""`pdecomp calibrate [-o FILE] [OVERRIDE ...]`: the local device's microbenchmark
(pdecomp.gate.microbench), the calibration the gate's forecast reads, printed as JSON or
written to FILE (a card's file for pdecomp/gate/calibrations, or PDECOMP_CALIBRATION's).
The measurement also replaces the local device's cached calibration, which gates read. With
a run's overrides, the step of that run is compiled too and every one of its dots measured
on this device (pdecomp.gate.dots), into the cache its gates read: a gate measures them for
a tenth of its compile time at most, so a new model's forecast is otherwise refined over its
first gates."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.commands.common import Parser, refuse
from pdecomp.core import storage

if TYPE_CHECKING:
    from pdecomp.core.config import RunConfig
    from pdecomp.gate.calibration import Calibration
    from pdecomp.plan.resolve import Run

PROG = "pdecomp calibrate"


def parser() -> Parser:
    p = Parser(prog=PROG, description="Measure what this machine's device achieves by the "
                                      "size of its work: the gate's forecast reads it.")
    p.add_argument("-o", "--out", help="write the calibration here (JSON); default: print it")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                   help="a run's overrides, as `pdecomp` takes them: its step's dots "
                        "measured too")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out).absolute() if args.out else None
    from pdecomp.core.config import ConfigError
    from pdecomp.gate import calibration

    if out is not None and (out.is_dir() or storage.unwritable(out.parent)):
        return refuse(PROG, f"-o {args.out}: a file to write, in a writable folder")
    if out is not None and out.exists():
        try:  # only a calibration is written over: anything else of the user's stays
            calibration.read(out)
        except ConfigError:
            return refuse(PROG, f"-o {args.out}: exists and is not a calibration file; "
                                "name a new file")
    run = None
    if args.overrides:
        from launcher import api

        try:
            run = local_run(api.compose(args.overrides))
        except ConfigError as e:
            return refuse(PROG, str(e))
    from pdecomp.gate import microbench  # jax starts only for a valid call

    cal = microbench.measure()
    cache = calibration.cache_path(cal.device)
    try:  # this machine's calibration for its gates from now on (their dots are read at it)
        calibration.write(cal, cache)
    except (OSError, storage.WriteFailed):
        print(f"{PROG}: {cache} not written: gates measure the device again", file=sys.stderr)
    if out is not None:
        calibration.write(cal, out)
        print(f"calibration of {cal.device}: {out}", file=sys.stderr)
    else:
        print(json.dumps(cal.to_json(), indent=1))
    if run is not None:
        print(step_dots(run, cal), file=sys.stderr)
    return 0


def local_run(cfg: RunConfig) -> Run:
    """The run resolved for this machine's devices (jax starts here); a deviceless one
    refused."""
    from pdecomp.core.config import ConfigError
    from pdecomp.run.decompose import prepare

    run = prepare(cfg)
    if run.placement.deviceless:
        raise ConfigError("gate.target", run.placement.target,
                          "calibrate measures this machine's devices; leave gate.target unset")
    return run


def step_dots(run: Run, cal: Calibration) -> str:
    """Every dot of the run's step measured with `cal` (cached for its gates);
    the line that says so, with the step's forecast as a `pdecomp` job's gate now makes it."""
    import jax

    from pdecomp.gate import forecast
    from pdecomp.gate.compiled import step_report
    from pdecomp.gate.step import prepare

    compiled, report = prepare(run, jax.random.PRNGKey(run.config.seed), False).compile(run)
    basis = forecast.Basis(cal, fresh_temporaries=False, local=True)
    f = step_report(compiled.as_text(), report.n_devices, 1, None, basis, report.fresh_bytes,
                    dots_budget_s=math.inf)["forecast"]
    rest = " (the others not measurable)" if f["dots_measured"] < f["dots"] else ""
    return (f"the step's dots: {f['dots_measured']} of {f['dots']} shapes measured{rest}; "
            f"forecast {f['s_per_step']:.4g} s a step (floor {f['floor_s']:.4g} s)")

"""`pdecomp calibrate [-o FILE]`: the local device's microbenchmark (pdecomp.gate.microbench),
the calibration the gate's forecast reads, printed as JSON or written to FILE (a card's file
for pdecomp/gate/calibrations, or PDECOMP_CALIBRATION's)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from launcher.commands.common import Parser, refuse
from pdecomp.core import storage

PROG = "pdecomp calibrate"


def parser() -> Parser:
    p = Parser(prog=PROG, description="Measure what this machine's device achieves by the "
                                      "size of its work: the gate's forecast reads it.")
    p.add_argument("-o", "--out", help="write the calibration here (JSON); default: print it")
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
    from pdecomp.gate import microbench  # jax starts only for a valid call

    cal = microbench.measure()
    if out is not None:
        calibration.write(cal, out)
        print(f"calibration of {cal.device}: {out}", file=sys.stderr)
    else:
        print(json.dumps(cal.to_json(), indent=1))
    return 0

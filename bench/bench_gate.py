"""Gate wall time on this machine: `pdecomp ... gate.only=true` end to end, for the toy
default and the largest preset, on the local CPU devices and deviceless for 64 B200s.

Prints a table: predicted peak per device, XLA compile seconds, the whole command's wall
seconds (Python, Hydra and JAX start-up included), and the ratio against the toy's local
gate; then what listing the largest temporaries (an XLA dump while compiling) costs.
Run: `make bench` (after `make install-gpu-compile` for the deviceless rows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

from pdecomp.core.units import fmt_bytes

PDECOMP = os.path.join(os.path.dirname(sys.executable), "pdecomp")
RESID3 = ["+experiment=resid_mlp3"]
B200_64 = ["gate.target=b200", "mesh=fsdp64"]
CASES: list[tuple[str, list[str]]] = [
    ("tms 5-2 (default), local CPU", []),
    ("tms 5-2, 64 x B200 deviceless", B200_64),
    ("resid MLP 3 layers, local CPU", RESID3),
    ("resid MLP 3 layers, 64 x B200 deviceless", [*RESID3, *B200_64]),
    ("resid MLP 3 layers C=1000 B=65536, 64 x B200", [*RESID3, *B200_64, "layers.C=1000",
                                                      "data.batch_size=65536"]),
]


def gate_only(args: list[str], run_dir: str) -> tuple[float, dict]:
    """The whole command's wall seconds and its gate report (a refusal, exit 3, too)."""
    cmd = [PDECOMP, "gate.only=true", "logging.wandb.mode=disabled", f"hydra.run.dir={run_dir}", *args]
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if res.returncode not in (0, 3):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return wall, json.loads(open(os.path.join(run_dir, "gate.json")).read())


def main() -> None:
    console = Console(width=130)
    table = Table(title="gate wall time (2-core CPU host)")
    for col in ("config", "devices", "peak / device", "compile s", "wall s", "wall / toy"):
        table.add_column(col)
    temps = Table(title="cost of listing the largest temporaries (XLA dump while compiling)")
    for col in ("config", "compile s, top_temps=0", "compile s, top_temps=8", "ratio"):
        temps.add_column(col)
    with tempfile.TemporaryDirectory() as d:
        gate_only([], f"{d}/warm")  # first start-up (file caches) is not the gate's cost
        toy = None
        for i, (name, args) in enumerate(CASES):
            wall, rep = gate_only(args, f"{d}/{i}")
            toy = toy or wall
            table.add_row(name, str(rep["n_devices"]), fmt_bytes(rep["peak_bytes"]), f"{rep['compile_s']:.2f}",
                          f"{wall:.1f}", f"{wall / toy:.2f}")
            if i in (0, 3):
                _, bare = gate_only([*args, "gate.top_temps=0"], f"{d}/{i}-bare")
                temps.add_row(name, f"{bare['compile_s']:.2f}", f"{rep['compile_s']:.2f}",
                              f"{rep['compile_s'] / bare['compile_s']:.2f}")
    console.print(table)
    console.print(temps)


if __name__ == "__main__":
    main()

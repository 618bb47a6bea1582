"""The GPU performance flags the peers set (NVIDIA's JAX-Toolbox and MaxText GPU scripts),
each measured alone against XLA's defaults, in one run: the same step (bench/time_step.py,
the gated executable timed) in a process of its own for each setting, the default first
and last (a drift between them says how far to trust a few percent). Rows go to
OUT/gpu_flags.json as they finish, so a run cut short keeps what it measured.

    python bench/gpu_flags.py --out OUT [--budget-s 300] [--steps 50] [--reduced]

A flag that helps every job by more than the spread of the two default runs is a candidate
for the GPU default (launcher/job.py); one that changes the peak (the remat pass off) is
reported with it, since a faster step that no longer fits is no gain. Collective combining
and pipelining flags need several GPUs and are not in the single-GPU list.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_suite import REDUCED_SPEED, SPEED_JOB

FLAGS = {  # name: XLA_FLAGS, one setting each, against "default"
    "default": "",
    "latency_hiding_scheduler": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "no_command_buffer": "--xla_gpu_enable_command_buffer=",
    "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    "while_loop_double_buffering": "--xla_gpu_enable_while_loop_double_buffering=true",
    "highest_priority_async_stream": "--xla_gpu_enable_highest_priority_async_stream=true",
    "no_remat_pass": "--xla_disable_hlo_passes=rematerialization",
}
JOBS = {  # name: overrides (SmolLM2's shapes, synthetic tokens: a step's time is the same)
    "smollm2_l28_8x128_bf16": [*SPEED_JOB, "data.source=synthetic", "data.batch_size=8",
                               "memory.matmul_dtype=bfloat16"],
    "smollm2_l28_64x128_bf16": [*SPEED_JOB, "data.source=synthetic", "data.batch_size=64",
                                "memory.matmul_dtype=bfloat16"],
}


def timed(overrides: list[str], flags: str, steps: int) -> dict:
    """One process's step under `flags`: its median seconds, peak bytes and forecast, or
    the error it ended with."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    cmd = [sys.executable, str(Path(__file__).parent / "time_step.py"), str(steps), *overrides]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"],
                "wall_s": wall}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"measured_s": r["measured_s"], "seconds": r["seconds"],
            "peak_bytes": r["peak_bytes"], "forecast_s": r["forecast"]["s_per_step"],
            "wall_s": wall}


def job_rows(name: str, overrides: list[str], steps: int, deadline: float,
             write: Callable[[dict | None], None]) -> dict:
    """Every setting of FLAGS for one job, the default again at the end; each against the
    mean of the two default runs."""
    runs: dict[str, dict] = {}
    for flag in [*FLAGS, "default_again"]:
        if time.perf_counter() > deadline:
            runs[flag] = {"skipped": "past the budget"}
            continue
        runs[flag] = timed(overrides, FLAGS.get(flag, ""), steps)
        print(f"{name} {flag}: {runs[flag].get('measured_s', runs[flag])}", flush=True)
        write({**_ratios(runs), "job": name})
    return {**_ratios(runs), "job": name}


def _ratios(runs: dict[str, dict]) -> dict:
    base = [r["measured_s"] for k, r in runs.items()
            if k.startswith("default") and "measured_s" in r]
    mean = statistics.fmean(base) if base else None
    for r in runs.values():
        if mean and "measured_s" in r:
            r["over_default"] = r["measured_s"] / mean
    spread = (max(base) / min(base) - 1) if len(base) == 2 else None
    return {"runs": runs, "default_s": mean, "default_spread": spread}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=300.0, help="no run starts past it")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--reduced", action="store_true", help="CPU-sized jobs")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline, rows = time.perf_counter() + args.budget_s, []
    path = args.out / "gpu_flags.json"

    def write(row: dict | None = None) -> None:  # the rows so far, the job in progress too
        done = [*rows, *([row] if row else [])]
        path.write_text(json.dumps({"flags": FLAGS, "rows": done}, indent=1) + "\n")

    for name, overrides in JOBS.items():
        extra = [*REDUCED_SPEED, "model.n_layers=4", "data.batch_size=2"] if args.reduced else []
        rows.append(job_rows(name, [*overrides, *extra], args.steps, deadline, write))
        write()
    print(f"flags: {path}", flush=True)


if __name__ == "__main__":
    main()

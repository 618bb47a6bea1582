"""The language-model step on this CPU: SmolLM2-135M's layer-28 MLP (3 sites, C = 512),
batch 8 x seq 128, faithfulness + importance minimality + one stochastic reconstruction of
all three sites with KL over the vocabulary, no PGD, no warm-up; one row per CI function.

Each row is a whole `pdecomp +experiment=smollm2_l28` run in its own process: the step's
time (the last logging interval, compile excluded), tokens/s, the process's peak resident
memory, the gate's predicted peak and matmul FLOPs per step (beside the analytic count of
`lm_flops.py`), and that rate against this CPU's float32 matmul peak measured in the same
run (a 4096^3 matmul through XLA).

Baseline: the public PyTorch SPD on the same job. `--reference FILE` reads the JSON line
that `bench_spd_reference.py` prints, measured on this machine (the ratio that means
something); without it, the figures issue #32 quoted from another 2-core host (below).

Rows per `--matmul-dtype` (float32, and bfloat16: `memory.matmul_dtype=bfloat16`, the
forwards' matmuls on bfloat16 operands summed in float32, each row's rate read against the
peak of its own operands); the bfloat16 rows' baseline is the reference's own default,
bfloat16 autocast (`--reference-bf16`).

Run: .venv/bin/python bench/bench_lm_cpu.py [--model DIR] [--data FILE] [--steps N]
(without --model: random weights of SmolLM2's shapes, which run at the same speed; without
--data: the synthetic token stream).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lm_flops import count, job_of
from peak import matmul_peak
from rich.console import Console
from rich.table import Table

# The reference's figures as issue #32 quoted them (PyTorch SPD at 3f0bb61, torch 2.13,
# fp32, another 2-core host, where pdecomp's step of that time took 1.84 s and the same code
# takes 2.86 s on an Intel 2-core host). The ratio to read is the one measured on the host
# at hand: XLA:CPU's float32 rate differs by host kind far more than torch's does
# (bench/RESULTS.md, "Speed on CPU, side by side with the PyTorch reference").
QUOTED = {"mlp": (4.44, 3.24), "shared_mlp": (4.18, 3.07), "vector_mlp": (4.52, 3.33)}
CI_FNS = {"mlp": "[16]", "shared_mlp": "[550]", "vector_mlp": "[8]"}
# A row's matmul operands -> the peak its rate is read against: (operand dtype, product's)
PEAKS = {"float32": ("float32", None), "bfloat16": ("bfloat16", "float32")}
JOB = ["loss.pgd.coeff=0", "optim.faith_warmup_steps=0", "loss.eval_pgd.n_steps=0",
       "data.eval_batches=1", "logging.wandb.mode=disabled", "logging.progress=false",
       "logging.plots=false", "logging.ckpt_every=100000"]


def job_args(ci_fn: str, model: str | None, data: str | None,
             extra: tuple[str, ...] = ()) -> list[str]:
    return [f"layers.ci_fn={ci_fn}", f"layers.ci_hidden={CI_FNS[ci_fn]}", *JOB,
            *([f"model.path={model}"] if model else []),
            *([f"data.path={data}"] if data else ["data.source=synthetic"]), *extra]


def analytic_flops(ci_fn: str, model: str | None, data: str | None,
                   extra: tuple[str, ...] = ()) -> int:
    from launcher import api

    return sum(count(job_of(api.compose(job_args(ci_fn, model, data, extra),
                                        preset="smollm2_l28"))).values())


def allocator() -> str:
    """The C allocator the rows run under: a preloaded one, or glibc's malloc. It moves the
    step by up to 17% and the 4096^3 peak by 16-24% on this host (bench/RESULTS.md): XLA:CPU
    maps its large per-call buffers anew on every call under glibc."""
    preload = os.environ.get("LD_PRELOAD", "").split()
    return ", ".join(Path(p).name for p in preload) if preload else "glibc malloc"


def run_job(ci_fn: str, steps: int, model: str | None, data: str | None,
            extra: tuple[str, ...] = ()) -> dict:
    pdecomp = str(Path(sys.executable).parent / "pdecomp")
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "run"
        args = ["+experiment=smollm2_l28", f"optim.steps={steps}",
                f"logging.log_every={max(steps // 2, 1)}", *job_args(ci_fn, model, data, extra),
                f"hydra.run.dir={run_dir}"]
        t0 = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", pdecomp, *args],
                              capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{ci_fn}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        rss_kb = int(proc.stderr.rsplit("maxrss_kb=", 1)[1].split()[0])
        history = json.loads((run_dir / "history.json").read_text())
        gate = json.loads((run_dir / "gate.json").read_text())
    step_s = history[-1]["perf/step_s"]
    return {"step_s": step_s, "tokens_per_s": history[-1].get("perf/tokens_per_s"),
            "rss_gb": rss_kb * 1024 / 1e9, "gate_peak_gib": gate["peak_bytes"] / 2 ** 30,
            "matmul_flops": gate["matmul_flops"],
            "analytic_flops": analytic_flops(ci_fn, model, data, extra), "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a Hugging Face directory (pdecomp convert)")
    p.add_argument("--data", help="a token file (pdecomp tokenize)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ci-fn", action="append", choices=list(CI_FNS))
    p.add_argument("--matmul-dtype", action="append", choices=list(PEAKS),
                   help="memory.matmul_dtype of a set of rows (default: float32)")
    p.add_argument("--reference", help="bench_spd_reference.py's JSON line, this machine's "
                                       "(--dtype float32): the float32 rows' baseline")
    p.add_argument("--reference-bf16", help="the same with --dtype autocast_bf16: the "
                                            "bfloat16 rows' baseline")
    p.add_argument("--override", action="append", default=[],
                   help="another override for every row")
    args = p.parse_args()
    reference = {"float32": QUOTED, "bfloat16": {}}
    for dt, path in (("float32", args.reference), ("bfloat16", args.reference_bf16)):
        if path:
            measured = json.loads(Path(path).read_text().strip().splitlines()[-1])
            reference[dt] = {k: (v["step_s"], v["rss_gb"]) for k, v in measured.items()}
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    dtypes = args.matmul_dtype or ["float32"]
    peak = {dt: matmul_peak(4096, PEAKS[dt][0], accumulate=PEAKS[dt][1]) / 1e9
            for dt in dtypes}  # GFLOP/s
    table = Table(title=f"LM step on {os.cpu_count()} cores, {allocator()}; matmul peak (4096^3 "
                        "through XLA) " + ", ".join(f"{dt} {v:.0f} GFLOP/s"
                                                   for dt, v in peak.items()))
    for col in ("CI fn", "matmul dtype", "s/step", "tokens/s", "peak RSS GB", "gate peak GiB",
                "matmul GFLOP/step", "analytic / gate", "GFLOP/s", "of its peak",
                "ref s/step", "speed-up", "ref RSS GB", "RSS ratio"):
        table.add_column(col, justify="right")
    rows = {}
    for dt in dtypes:
        for ci_fn in args.ci_fn or list(CI_FNS):
            r = rows[f"{ci_fn}/{dt}"] = run_job(ci_fn, args.steps, args.model, args.data,
                                                (f"memory.matmul_dtype={dt}", *args.override))
            rate = r["matmul_flops"] / r["step_s"] / 1e9
            ref = reference[dt].get(ci_fn)
            table.add_row(ci_fn, dt, f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.0f}",
                          f"{r['rss_gb']:.2f}", f"{r['gate_peak_gib']:.2f}",
                          f"{r['matmul_flops'] / 1e9:.0f}",
                          f"{r['analytic_flops'] / r['matmul_flops']:.4f}", f"{rate:.0f}",
                          f"{rate / peak[dt]:.0%}",
                          *((f"{ref[0]:.2f}", f"{ref[0] / r['step_s']:.2f}x", f"{ref[1]:.2f}",
                             f"{r['rss_gb'] / ref[1]:.2f}x") if ref else ("-",) * 4))
    Console(width=240).print(table)
    print(json.dumps({"allocator": allocator(), "matmul_peak_gflops": peak, "rows": rows}))


if __name__ == "__main__":
    main()

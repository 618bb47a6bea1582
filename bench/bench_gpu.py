"""On one GPU: the gate's predicted peak against the measured `peak_bytes_in_use`, and the
step's throughput and model FLOP utilization, for jobs of very different sizes.

Each job is a whole `pdecomp` run in its own process (the parent never imports JAX, so it
holds no GPU memory). Per job: the gate's predicted peak per device, the peak the backend
reports after the run (`peak_bytes_in_use`, evaluation included; `gate.json`), the step's
time over the last logging interval (compile excluded), tokens or examples per second, the
gate's matmul FLOPs per step, and that rate against this GPU's matmul peak measured in the
same run (an 8192^3 product through XLA, in the job's compute dtype at JAX's default
precision). JAX's memory settings are the job's own (`memory.safety_fraction`, exported as
XLA_CLIENT_MEM_FRACTION; nothing else set unless the caller's environment sets it) and are
printed with the table.

Run: python bench/bench_gpu.py [--job NAME ...] [--model DIR] [--data FILE] [--json FILE]
(`--model`/`--data`: SmolLM2-135M from `pdecomp convert` and a token file from `pdecomp
tokenize`, for the smollm2 job; without them it runs random weights on synthetic tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peak import matmul_peak

GiB = 2 ** 30
QUIET = ["logging.wandb.mode=disabled", "logging.progress=false", "logging.plots=false",
         "logging.ckpt_every=100000"]
# name -> (overrides, compute dtype of its matmuls, what it is)
JOBS: dict[str, tuple[list[str], str, str]] = {
    "tms_5-2": (["+experiment=tms_5-2", "optim.steps=400", "logging.log_every=200"],
                "float32", "toy: 5 features in 2 dims, C = 20"),
    "resid_mlp2": (["+experiment=resid_mlp2", "optim.steps=400", "logging.log_every=200"],
                   "float32", "toy: residual MLP, 2 layers"),
    "smollm2_l28": (["+experiment=smollm2_l28", "optim.faith_warmup_steps=50",
                     "optim.steps=200", "logging.log_every=100"],
                    "float32", "SmolLM2-135M layer 28 MLP, C = 512, batch 8 x 128 (preset)"),
    "llama8b_l18_scaled": (
        ["+experiment=llama8b_l18-26_chunkwise", "layers=l18",
         "loss.recon.chunkwise.sites_per_chunk=3", "layers.C=16384", "model.n_layers=20",
         "data.source=synthetic", "data.batch_size=32", "data.seq_len=512",
         "optim.microbatches=4", "optim.microbatch_size=0", "mesh=single", "optim.faith_warmup_steps=0",
         "optim.steps=20", "logging.log_every=10", "loss.eval_pgd.n_steps=0",
         "data.eval_batches=1"],
        "bfloat16", ("Llama-3.1-8B shapes, 20 layers, layer 18 MLP (3 sites, C = 16384), "
                     "batch 32 x 512 in 4 microbatches, random weights")),
}


def pdecomp_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "pdecomp"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("pdecomp")
    return [found] if found else [sys.executable, "-c",
                                  "import sys; from launcher.app import main; sys.exit(main())"]


def run_job(name: str, model: str | None, data: str | None, extra: list[str]) -> dict:
    overrides = list(JOBS[name][0])
    if name.startswith("smollm2"):
        overrides += [f"model.path={model}"] if model else []
        overrides += [f"data.path={data}"] if data else ["data.source=synthetic"]
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "run"
        t0 = time.perf_counter()
        proc = subprocess.run([*pdecomp_cmd(), *overrides, *QUIET, *extra,
                               f"hydra.run.dir={run_dir}"],
                              capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}", "wall_s": wall}
        history = json.loads((run_dir / "history.json").read_text())
        gate = json.loads((run_dir / "gate.json").read_text())
    last = history[-1]
    return {"step_s": last["perf/step_s"], "tokens_per_s": last.get("perf/tokens_per_s"),
            "examples_per_s": last.get("perf/examples_per_s"),
            "predicted_peak_bytes": gate["peak_bytes"],
            "measured_peak_bytes": gate.get("measured_peak_bytes"),
            "measured_by_phase": gate.get("measured_peak_by_phase_bytes"),
            "peak_in_training": max((h["hbm/peak_gib"] * GiB for h in history
                                     if "hbm/peak_gib" in h), default=None),
            "cap_bytes": gate["cap_bytes"], "cap_source": gate["cap_source"],
            "memory_env": gate.get("memory_env"), "matmul_flops": gate["matmul_flops"],
            "compile_s": gate["compile_s"], "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", action="append", choices=list(JOBS))
    p.add_argument("--model", help="SmolLM2-135M as a Hugging Face directory")
    p.add_argument("--data", help="a token file for the smollm2 job")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("overrides", nargs="*", help="more overrides for every job")
    args = p.parse_args()
    peaks = {dt: matmul_peak(8192, dt, repeats=10) / 1e12 for dt in ("bfloat16", "float32")}
    print(f"matmul peak (8192^3 through XLA, default precision): "
          f"bfloat16 {peaks['bfloat16']:.0f} TFLOP/s, float32 {peaks['float32']:.0f} TFLOP/s")
    mem_vars = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "TF_GPU"))}
    print(f"caller's memory environment: {mem_vars or 'none set'}")
    rows = {}
    head = ("| job | predicted peak GiB | measured peak GiB | predicted / measured | s/step "
            "| tokens/s | matmul TFLOP/step | TFLOP/s | MFU (of measured peak) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in args.job or list(JOBS):
        r = rows[name] = run_job(name, args.model, args.data, args.overrides)
        if "error" in r:
            print(f"{name}: {r['error']}", flush=True)
            continue
        dtype = JOBS[name][1]
        rate = r["matmul_flops"] / r["step_s"] / 1e12
        r["tflops"], r["mfu"] = rate, rate / peaks[dtype]
        meas = r["measured_peak_bytes"]
        ratio = f"{r['predicted_peak_bytes'] / meas:.3f}" if meas else "-"
        tps = r["tokens_per_s"] or r["examples_per_s"]
        lines.append(f"| {name} | {r['predicted_peak_bytes'] / GiB:.3f} | "
                     f"{(meas or 0) / GiB:.3f} | {ratio} | {r['step_s']:.4f} | {tps:,.0f} | "
                     f"{r['matmul_flops'] / 1e12:.3f} | {rate:.1f} | {r['mfu']:.1%} ({dtype}) |")
        phases = ", ".join(f"{k} {v / GiB:.3f}" for k, v in (r["measured_by_phase"] or {}).items())
        print(lines[-1], f" memory: {r['memory_env']}; wall {r['wall_s']:.0f} s; measured "
              f"peak GiB after: {phases}", flush=True)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_peak_tflops": peaks, "rows": rows,
                                               "jobs": {k: JOBS[k] for k in rows}}, indent=1))


if __name__ == "__main__":
    main()

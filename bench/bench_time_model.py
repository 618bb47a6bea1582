"""The gate's forecast (pdecomp.gate.forecast) against measured steps, its calibration taken
from microbenchmarks only, never fitted to these jobs; rows go into bench/results.json under
"time_model".

- GPU rows: each job of the GPU suite whose step was timed on one H200 or H100
  (bench/results.json "gpu") gated again deviceless for that card on this machine, with the
  card's calibration file (pdecomp/gate/calibrations), beside the measured step and the floor
  (the roofline at the card's published rates, pdecomp.gate.step_cost).
- CPU rows (`--cpu`, `--cpu-job NAME` for some): the TMS 5-2 step and the SmolLM2
  layer-28 step, and seven held out (TMS 40-10, the 1-layer residual MLP, the chunkwise
  LM method on llama_tiny: chosen after the model was built; then TMS 5-2 and 40-10 with
  identity hidden layers, the 3-layer residual MLP and the published recipe on SmolLM2),
  measured here
  (bench/time_step.py: the gated executable timed, median of its steps, in three processes;
  in a `pdecomp` job's process, which reuses a step's temporaries, and the first two in a
  library caller's too, `_library`, which maps them anew each step)
  beside the forecast the same gate made with this CPU's calibration, measured in that
  process before the steps and again after each of three blocks of them
  (pdecomp.gate.microbench; the step's dots by pdecomp.gate.dots), each block against the
  mean of the two either side: this host's speed drifts by up to 2x over minutes, so a
  calibration cached from another spell would compare two spells, not a forecast with its
  step.

    .venv/bin/python bench/bench_time_model.py                  # every GPU job
    .venv/bin/python bench/bench_time_model.py --cpu --job none # the CPU rows only
    .venv/bin/python bench/bench_time_model.py --job llama8b_all7_l18

The speed jobs use SmolLM2-135M's shapes with random weights, as the suite did (a step's time
does not depend on them): `--model SMOLLM2_DIR` (`pdecomp convert` of its GGUF) copies its
config; without it, the preset's shapes and synthetic tokens. The measured step is the
suite's (its commit is in each row); the forecast is this commit's program.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_gate import gate_only
from bench_gpu import JOBS as GPU_JOBS
from gpu_suite import SPEED_JOB, quality_job, random_model, random_tokens

RESULTS = Path(__file__).resolve().parent / "results.json"


SEVEN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# the suite's 8B job with attention sites (bench/gpu_suite.json "gate_8b_attention")
L18_ALL7 = ["+experiment=llama8b_l18-26_chunkwise", "layers=l18",
            f"layers.sites=[{','.join(f'layers.18.{m}' for m in SEVEN)}]",
            "loss.recon.chunkwise.sites_per_chunk=7", "layers.C=4096", "model.n_layers=20",
            "data.source=synthetic", "data.batch_size=32", "data.seq_len=512",
            "optim.microbatches=4", "optim.microbatch_size=0", "mesh=single",
            "optim.faith_warmup_steps=0", "optim.steps=20", "loss.eval_pgd.n_steps=0",
            "data.eval_batches=0", "memory.matmul_dtype=bfloat16"]
L18_ALL7_MEASURED = "llama8b_shapes_20_layers_layer18_all_7_matrices_C4096_32x512_bf16"


# The CPU rows: name -> (steps timed, overrides); a third of the steps about a calibration's
# time. ACCEPTANCE are the jobs the forecast was built on, timed in a library caller's process
# too; the rest are held out: chosen after the model was built and never examined while
# building it (other models, another method: the class of step a user brings).
# an LM job's train step alone: no fresh-PGD evaluation, no faithfulness warm-up program
LM_STEP = ["loss.eval_pgd.n_steps=0", "optim.faith_warmup_steps=0"]
CPU_JOBS = {
    "tms_5-2": (3000, []),
    "smollm2_l28": (18, ["+experiment=smollm2_l28", "data.source=synthetic", *LM_STEP,
                        "data.eval_batches=0"]),
    "tms_40-10": (360, ["+experiment=tms_40-10"]),
    "resid_mlp1": (450, ["+experiment=resid_mlp1"]),
    "llama_tiny_chunkwise": (108, ["+experiment=llama_tiny_chunkwise", *LM_STEP,
                                   "data.eval_batches=0"]),
    "tms_5-2-id": (3000, ["+experiment=tms_5-2-id"]),
    "tms_40-10-id": (360, ["+experiment=tms_40-10-id"]),
    "resid_mlp3": (150, ["+experiment=resid_mlp3"]),
    # its evaluation in the loop needs a held-out batch (never run in the steps timed)
    "smollm2_published": (9, ["+experiment=smollm2_l28_published", "data.source=synthetic",
                              *LM_STEP, "data.eval_batches=1"]),
}
ACCEPTANCE = ("tms_5-2", "smollm2_l28")


def jobs(model: Path | None, data: Path | None) -> dict[str, tuple[str, str, list[str]]]:
    """name: (the measured job's name in results.json "gpu", the card, the overrides)."""
    files = ([f"model.path={model}", f"data.path={data}"] if model else
             ["data.source=synthetic"])
    speed = {f"smollm2_l28_mlp_ci_{b}x128_{dt}": (
        f"smollm2_l28_mlp_ci_{b}x128_{dt}", "h200",
        [*SPEED_JOB, f"data.batch_size={b}", f"memory.matmul_dtype={dt}", *files])
        for b in (8, 64) for dt in ("float32", "bfloat16")}
    return {**speed,
            "quality_12_sites": ("quality_12_sites_C1024_16x128_f32", "h200",
                                 [*quality_job(False, 2000), *files]),
            "llama8b_all7_l18": (L18_ALL7_MEASURED, "h200", L18_ALL7),
            "llama8b_l18_scaled_h100": ("llama8b_l18_scaled", "h100",
                                        GPU_JOBS["llama8b_l18_scaled"][0])}


def row(name: str, card: str, measured: dict, report: dict, wall_s: float) -> dict:
    step = report["step"]
    t, f = step["time"], step["forecast"]
    s = measured["s_per_step"]
    return {"job": name, "card": card, "measured_job": measured["job"],
            "measured_commit": measured["commit"], "measured_s": s,
            "measured_matmul_flops": measured["tflops"] * 1e12 * s,
            "matmul_flops": report["matmul_flops"], "flops_per_device": step["flops"],
            "f32_flops": step.get("f32_flops"), "hbm_bytes": step["hbm_bytes"],
            "time": t, "floor_s": t["roofline_s"], "bound": t["bound"], "forecast": f,
            "forecast_s": f["s_per_step"], "forecast_error": f["s_per_step"] / s - 1,
            "calibration": f["calibration"], "gate_wall_s": wall_s, "commit": _commit()}


def cpu_row(name: str, steps: int, overrides: list[str], library: bool,
            repeats: int = 3) -> dict:
    """A CPU job timed in `repeats` processes of its own (bench/time_step.py: a `pdecomp`
    job's process, or with `library` a library caller's), each calibrated first, its
    forecast against its measured step: the run of the median error, and every run's."""
    cmd = [sys.executable, str(Path(__file__).parent / "time_step.py"), "--calibrate",
           *(["--library"] if library else []), str(steps), *overrides]
    runs = []
    for _ in range(repeats):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    errors = [r["forecast_s"] / r["measured_s"] - 1 for r in runs]
    mid = sorted(range(repeats), key=errors.__getitem__)[repeats // 2]  # the median run
    f, measured = runs[mid]["forecast"], runs[mid]["measured_s"]
    return {"job": name, "card": "cpu", "cpu": _cpu(), "measured_s": measured,
            "runs_s": [r["measured_s"] for r in runs], "seconds": [_spread(r["seconds"]) for r in runs],
            "forecast": f, "forecast_s": runs[mid]["forecast_s"], "floor_s": f["floor_s"],
            "forecasts_s": [r["forecast_s"] for r in runs],
            "calibrations_s": [r["forecasts_s"] for r in runs],
            "blocks_s": [r["blocks_s"] for r in runs],
            "block_errors": [r["block_errors"] for r in runs],
            "forecast_error": errors[mid], "errors_by_run": errors,
            "calibration": f["calibration"], "temp_bytes": runs[-1]["temp_bytes"],
            "minor_faults_per_step": runs[mid]["minor_faults_per_step"],
            "faults_by_run": [r["minor_faults_per_step"] for r in runs],
            "overrides": overrides, "commit": _commit()}


def _spread(seconds: list[float]) -> list[float] | dict[str, float]:
    """A run's step seconds: each, or for many steps their quantiles."""
    if len(seconds) <= 100:
        return seconds
    q = statistics.quantiles(seconds, n=10)
    return {"min": min(seconds), "p10": q[0], "p50": statistics.median(seconds), "p90": q[-1],
            "max": max(seconds), "steps": len(seconds)}


def _cpu() -> str:
    from pdecomp.gate.calibration import cpu_model

    return f"{cpu_model()} x {os.cpu_count()}"


def _commit() -> str | None:
    """The checkout's commit, short, as a run records it (pdecomp.plan.resolve)."""
    from pdecomp.plan.resolve import provenance

    commit = provenance()["commit"]  # "-dirty" where pdecomp/ or launcher/ have changed
    return commit[:7] + commit[40:] if commit else None


def record(rows: dict[str, dict]) -> None:
    data = json.loads(RESULTS.read_text())  # other benches may have written meanwhile
    data["time_model"] = {"command": "bench/bench_time_model.py [--cpu]",
                          "rows": list(rows.values())}
    RESULTS.write_text(json.dumps(data, indent=1, default=str) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="SmolLM2-135M, Hugging Face form")
    p.add_argument("--job", action="append", help="only these GPU jobs ('none': no GPU job)")
    p.add_argument("--cpu", action="store_true", help="the CPU rows too")
    p.add_argument("--cpu-job", action="append", choices=list(CPU_JOBS),
                   help="with --cpu: only these CPU jobs")
    args = p.parse_args()
    measured = {j["job"]: j for j in json.loads(RESULTS.read_text())["gpu"]["jobs"]}
    rows = {r["job"]: r for r in json.loads(RESULTS.read_text()).get(
        "time_model", {}).get("rows", [])}
    for name, (steps, overrides) in CPU_JOBS.items() if args.cpu else ():
        if args.cpu_job and name not in args.cpu_job:
            continue
        for library in (False, True) if name in ACCEPTANCE else (False,):
            key = f"cpu_{name}{'_library' * library}"
            rows[key] = {**cpu_row(key, steps, overrides, library),
                         "held_out": name not in ACCEPTANCE}
            print(json.dumps(rows[key]), flush=True)
            record(rows)
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model = random_model(args.model, work / "model", None) if args.model else None
        data = random_tokens(work / "tokens.u16", 49152, 400_000) if args.model else None
        table = jobs(model, data)
        for name in [j for j in args.job or list(table) if j != "none"]:
            key, card, overrides = table[name]
            wall, report = gate_only([*overrides, f"gate.target={card}"], str(work / name))
            rows[name] = row(name, card, measured[key], report, wall)
            print(json.dumps(rows[name]), flush=True)
            record(rows)


if __name__ == "__main__":
    main()

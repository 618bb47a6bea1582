"""The gate's time model against step times measured on GPUs: each job of the GPU suite whose
step was timed on one H200 or H100 (bench/results.json "gpu") gated again deviceless for that
card on this machine, its predicted step (pdecomp.gate.step_cost: a roofline at the card's
published rates) beside the measured one; rows go into bench/results.json under "time_model".

    .venv/bin/python bench/bench_time_model.py --model SMOLLM2_DIR          # every job
    .venv/bin/python bench/bench_time_model.py --model SMOLLM2_DIR --job llama8b_all7_l18

SMOLLM2_DIR: SmolLM2-135M in Hugging Face form (`pdecomp convert` of its GGUF); the speed jobs
use its shapes with random weights, as the suite did (a step's time does not depend on them).
The measured step is the suite's (its commit is in each row); the prediction is this commit's
program, whose matmul FLOPs are checked equal to the measured run's.
"""

from __future__ import annotations

import argparse
import json
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


def jobs(model: Path, data: Path) -> dict[str, tuple[str, str, list[str]]]:
    """name: (the measured job's name in results.json "gpu", the card, the overrides)."""
    files = [f"model.path={model}", f"data.path={data}"]
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
    t = step["time"]
    s = measured["s_per_step"]
    return {"job": name, "card": card, "measured_job": measured["job"],
            "measured_commit": measured["commit"], "measured_s": s,
            "measured_matmul_flops": measured["tflops"] * 1e12 * s,
            "matmul_flops": report["matmul_flops"], "flops_per_device": step["flops"],
            "f32_flops": step.get("f32_flops"), "hbm_bytes": step["hbm_bytes"],
            "time": t, "predicted_s": t["roofline_s"], "bound": t["bound"],
            "measured_over_predicted": s / t["roofline_s"], "gate_wall_s": wall_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="SmolLM2-135M, Hugging Face form")
    p.add_argument("--job", action="append", help="only these (default: every one)")
    args = p.parse_args()
    measured = {j["job"]: j for j in json.loads(RESULTS.read_text())["gpu"]["jobs"]}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model = random_model(args.model, work / "model", None)
        data = random_tokens(work / "tokens.u16", 49152, 400_000)
        table = jobs(model, data)
        rows = {r["job"]: r for r in json.loads(RESULTS.read_text()).get(
            "time_model", {}).get("rows", [])}
        for name in args.job or list(table):
            key, card, overrides = table[name]
            wall, report = gate_only([*overrides, f"gate.target={card}"], str(work / name))
            rows[name] = row(name, card, measured[key], report, wall)
            print(json.dumps(rows[name]), flush=True)
            data_ = json.loads(RESULTS.read_text())  # other benches may have written meanwhile
            data_["time_model"] = {"command": "bench/bench_time_model.py --model SMOLLM2_DIR",
                                   "rows": list(rows.values())}
            RESULTS.write_text(json.dumps(data_, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()

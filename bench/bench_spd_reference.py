"""The baseline of `bench_lm_cpu.py`, measured on this machine: the public PyTorch SPD on the
same job (SmolLM2's layer-28 MLP, 3 sites, C = 512 each, batch 8 x 128 tokens of the same
token file, faithfulness + importance minimality + one stochastic reconstruction of all
sites with KL, no PGD, no warm-up), one row per CI function.

Needs what pdecomp does not: a checkout of goodfire-ai/spd (at 3f0bb61) and a Python with
torch, transformers, datasets and that checkout's light dependencies (pydantic<2.12, fire,
tqdm, jaxtyping, einops, python-dotenv, matplotlib, scipy, sympy, wandb). Run it with
pdecomp's venv (it writes the token windows as a JSON-lines dataset with numpy):

    .venv/bin/python bench/bench_spd_reference.py --spd SPD_CHECKOUT --python TORCH_PYTHON \\
        --model MODEL_DIR --data TOKENS_FILE [--dtype float32|autocast_bf16]

Each row is two runs of `spd.experiments.lm.lm_decomposition` (3 and 13 steps, one
process each): s/step is the difference of their wall times over 10 steps (start-up, the
step-0 evaluation and saving cancel), the peak resident memory that of the longer run.
`--dtype float32` (the default) sets the reference's `autocast_bf16: false`, the job
pdecomp runs; its own default autocasts to bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

CI_FNS = {"mlp": 16, "shared_mlp": 550, "vector_mlp": 8}
SITES = [f"model.layers.28.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]


def config(ci_fn: str, steps: int, model: str, data_dir: Path, bf16: bool,
           batch: int = 8) -> dict:
    """The reference's config for the job (its LM task reading a local JSON-lines dataset)."""
    return {
        "autocast_bf16": bf16, "wandb_project": None, "seed": 0, "n_mask_samples": 1,
        "ci_fn_type": ci_fn, "ci_fn_hidden_dims": [CI_FNS[ci_fn]], "sampling": "continuous",
        "sigmoid_type": "leaky_hard",
        "module_info": [{"module_pattern": s, "C": 512} for s in SITES],
        "identity_module_info": None, "use_delta_component": True,
        "loss_metric_configs": [
            {"classname": "ImportanceMinimalityLoss", "coeff": 1e-4, "pnorm": 2.0,
             "beta": 0.2, "p_anneal_start_frac": 0.0, "p_anneal_final_p": 0.4,
             "p_anneal_end_frac": 1.0, "eps": 1e-12},
            {"classname": "StochasticReconLoss", "coeff": 1.0},
            {"classname": "FaithfulnessLoss", "coeff": 1e5}],
        "output_loss_type": "kl", "steps": steps, "batch_size": batch,
        "faithfulness_warmup_steps": 0, "faithfulness_warmup_lr": 1e-3,
        "faithfulness_warmup_weight_decay": 0.0,
        "lr_schedule": {"start_val": 1e-3, "fn_type": "cosine", "warmup_pct": 0.0,
                        "final_val_frac": 0.1},
        "train_log_freq": 100000, "eval_freq": 100000, "eval_batch_size": batch,
        "slow_eval_freq": 100000, "n_eval_steps": 1, "slow_eval_on_first_step": False,
        "save_freq": None, "eval_metric_configs": [], "ci_alive_threshold": 0.0,
        "pretrained_model_class": "transformers.LlamaForCausalLM",
        "pretrained_model_path": None, "pretrained_model_name": model,
        "pretrained_model_output_attr": "logits", "tokenizer_name": model,
        "task_config": {"task_name": "lm", "max_seq_len": 128, "buffer_size": 1000,
                        "dataset_name": str(data_dir), "column_name": "input_ids",
                        "train_data_split": "train", "eval_data_split": "train",
                        "shuffle_each_epoch": True, "is_tokenized": True,
                        "streaming": False},
    }


def write_data(tokens_file: str, out: Path, seq: int = 128) -> None:
    """The token file's windows as a local JSON-lines dataset of `input_ids`."""
    meta = json.loads(Path(tokens_file + ".json").read_text())
    toks = np.fromfile(tokens_file, dtype=meta["dtype"])
    rows = toks[: len(toks) // seq * seq].reshape(-1, seq)
    out.mkdir(parents=True)
    with open(out / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"input_ids": r.tolist()}) + "\n" for r in rows)


def run(python: str, env: dict, cfg_path: Path, cwd: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", python, "-m",
                           "spd.experiments.lm.lm_decomposition", "--config_path",
                           str(cfg_path)], cwd=cwd, env=env, capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg_path.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return wall, int(proc.stderr.rsplit("maxrss_kb=", 1)[1].split()[0]) * 1024 / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spd", required=True, help="a checkout of goodfire-ai/spd")
    p.add_argument("--python", required=True, help="a Python with torch and its deps")
    p.add_argument("--model", required=True, help="a Hugging Face directory")
    p.add_argument("--data", required=True, help="a token file (pdecomp tokenize)")
    p.add_argument("--dtype", choices=("float32", "autocast_bf16"), default="float32")
    args = p.parse_args()
    table = Table(title=f"PyTorch SPD on {os.cpu_count()} cores ({args.dtype})")
    for col in ("CI fn", "s/step", "peak RSS GB"):
        table.add_column(col, justify="right")
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        write_data(args.data, work / "data")
        # The reference imports wandb_workspaces (report building) at module level; a
        # timing run never calls it, and its dependency wandb_gql is not on the index.
        stub = work / "stub" / "wandb_workspaces"
        (stub / "reports").mkdir(parents=True)
        for f in ("__init__.py", "workspaces.py", "reports/__init__.py", "reports/v2.py"):
            (stub / f).write_text("")
        env = {**os.environ, "WANDB_MODE": "disabled", "HOME": d,
               "PYTHONPATH": f"{args.spd}:{work / 'stub'}"}
        for ci_fn in CI_FNS:
            walls, rss = {}, 0.0
            for steps in (3, 13):
                path = work / f"{ci_fn}_{steps}.json"
                path.write_text(json.dumps(config(ci_fn, steps, args.model, work / "data",
                                                  args.dtype == "autocast_bf16")))
                walls[steps], rss = run(args.python, env, path, work)
            step_s = (walls[13] - walls[3]) / 10
            rows[ci_fn] = {"step_s": step_s, "rss_gb": rss}
            table.add_row(ci_fn, f"{step_s:.2f}", f"{rss:.2f}")
    Console(width=120).print(table)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

"""Does the robust recipe do what it is for? Fresh-adversary KL against training steps, on a
job this CPU can run: SmolLM2-135M's layer-28 MLP (3 sites), windows of 4 x 64 tokens.

Arms (each a whole `pdecomp +experiment=smollm2_l28` run, one after the other):
- `robust`: persistent PGD 0.5, one source per example and position (`per_token`), 2
  warm-up ascents, CI-function gradients clipped at 1 (the GPU quality job's recipe);
- `no_pgd`: the same with persistent PGD off;
- `robust_4x`: the robust recipe at 4x the steps;
- `robust_4x_warm8`: the same with 8 warm-up ascents of the persistent adversary a step
  (the peers' advice when a fresh adversary beats the persistent one: more ascents);
- `published`: the published recipe's preset (`+experiment=smollm2_l28_published`).

Every arm evaluates in the loop (`logging.eval_every`) on the same held-out batches with
the field's adversary (`loss.eval_pgd.scope=shared`: one source per site for the whole
batch and every position, 20 sign ascents of 0.1); at the end, the fresh-adversary KL after
20 / 40 / 80 / 160 ascents, the zero-ablation KL of the same sites and L0 (CI > 0 and CI >
the run's threshold). Writes `<out>/robustness.json` and `<out>/robustness.png`.

Run: .venv/bin/python bench/bench_robustness.py --model DIR --data FILE --out DIR
(`bench/gpu_suite.py prepare --out DIR` makes the model and the token file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROBUST = ["loss.pgd.coeff=0.5", "loss.pgd.scope=per_token", "loss.pgd.n_warmup=2",
          "optim.ci_fn.clip_norm=1.0"]
ARMS = {"robust": (["+experiment=smollm2_l28", *ROBUST], 1),
        "no_pgd": (["+experiment=smollm2_l28", *ROBUST, "loss.pgd.coeff=0"], 1),
        "robust_4x": (["+experiment=smollm2_l28", *ROBUST], 4),
        "robust_4x_warm8": (["+experiment=smollm2_l28", *ROBUST, "loss.pgd.n_warmup=8"], 4),
        "published": (["+experiment=smollm2_l28_published"], 1)}
MARKS = (20, 40, 80, 160)


def job(arm: str, args: argparse.Namespace) -> list[str]:
    """The arm's command-line overrides (its preset, the CPU-sized job, the evaluation; an arm
    of k times the steps evaluates k times as far apart)."""
    over, times = ARMS[arm]
    steps = args.steps * times
    return [*over, f"model.path={args.model}", f"data.path={args.data}",
            f"layers.C={args.C}", "data.batch_size=4", "data.seq_len=64",
            f"optim.steps={steps}", f"logging.log_every={max(steps // 20, 1)}",
            f"logging.eval_every={args.eval_every * times}",
            f"logging.ckpt_every={max(steps // 10, 1)}",  # history.json as it goes
            f"data.eval_batches={args.eval_batches}", "loss.eval_pgd.scope=shared",
            "loss.eval_pgd.n_steps=20", "logging.wandb.mode=disabled"]


def train(arm: str, args: argparse.Namespace) -> Path:
    """The arm's run (kept: an arm whose summary exists is not trained again)."""
    run_dir = Path(args.out) / arm
    if (run_dir / "summary.json").is_file():
        return run_dir
    t0 = time.perf_counter()
    with open(Path(args.out) / f"{arm}.log", "w") as log:
        subprocess.run([str(ROOT / ".venv" / "bin" / "pdecomp"), *job(arm, args),
                        f"hydra.run.dir={run_dir}"], check=True, stdout=log,
                       stderr=subprocess.STDOUT)
    print(f"{arm}: trained in {time.perf_counter() - t0:.0f} s", flush=True)
    return run_dir


def final_figures(run_dir: Path) -> dict:
    """The fresh adversary's KL after each of MARKS ascents (the field's scope), the
    zero-ablation KL and L0 of the run's own final evaluation."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_suite import pgd_curve

    summary = json.loads((run_dir / "summary.json").read_text())
    curve = pgd_curve(run_dir, MARKS, "shared", None)
    l0 = {k: v for k, v in summary.items() if k.startswith("l0/")}
    l0_any = {k: v for k, v in summary.items() if k.startswith("l0_any/")}
    return {"kl_pgd": {n: curve[f"shared/{n}"]["kl"] for n in MARKS},
            "kl_zero": summary.get("kl/zero"), "kl_stochastic": summary.get("kl/stochastic"),
            "ce_unrecovered_stochastic": summary.get("ce_unrecovered/stochastic"),
            "l0_above_threshold": l0, "l0_above_0": l0_any, "steps": summary.get("steps")}


def curves(run_dir: Path) -> dict[str, list]:
    """The in-loop evaluation's figures against steps."""
    history = json.loads((run_dir / "history.json").read_text())
    rows = [h for h in history if "eval/kl/pgd" in h]
    return {"step": [h["step"] for h in rows], "kl_pgd": [h["eval/kl/pgd"] for h in rows],
            "kl_zero": [h["eval/kl/zero"] for h in rows],
            "kl_stochastic": [h["eval/kl/stochastic"] for h in rows],
            "loss_pgd": [h.get("loss/pgd") for h in history if "loss/total" in h]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, r in results["arms"].items():
        c = r["curve"]
        ax.plot(c["step"], c["kl_pgd"], marker="o", ms=3, label=f"{arm}: fresh PGD-20 KL")
    zero = [r["curve"]["kl_zero"][-1] for r in results["arms"].values() if r["curve"]["step"]]
    if zero:
        ax.axhline(zero[0], color="k", ls="--", lw=1, label="zero-ablation KL (3 sites)")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("KL to the target (nats), held out")
    ax.set_title("SmolLM2 layer-28 MLP: the field's fresh adversary (shared source, 20 ascents)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--C", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--jobs", type=int, default=1,
                   help="arms trained at once (each process then shares the cores)")
    p.add_argument("--collect-only", action="store_true",
                   help="train nothing: read the arms' run directories as they stand (an "
                        "unfinished run: its curve so far, no final figures)")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "robustness.json"
    results = json.loads(out.read_text()) if out.is_file() else {"arms": {}}
    results["job"] = {k: v for k, v in vars(args).items() if k not in ("out", "arms")}
    arms = args.arms.split(",")
    if args.collect_only:
        run_dirs = {a: Path(args.out) / a for a in arms if (Path(args.out) / a).is_dir()}
    else:
        with ThreadPoolExecutor(args.jobs) as pool:  # the runs are processes of their own
            run_dirs = dict(zip(arms, pool.map(lambda a: train(a, args), arms)))
    for arm, run_dir in run_dirs.items():
        finished = (run_dir / "summary.json").is_file()
        known = (results["arms"].get(arm) or {}).get("final")  # its 160 ascents take minutes
        final = (known or final_figures(run_dir)) if finished else None
        results["arms"][arm] = {"overrides": job(arm, args), "curve": curves(run_dir),
                                "final": final}
        out.write_text(json.dumps(results, indent=1))
        plot(results, Path(args.out) / "robustness.png")
        print(json.dumps({arm: results["arms"][arm]["final"]}), flush=True)


if __name__ == "__main__":
    main()

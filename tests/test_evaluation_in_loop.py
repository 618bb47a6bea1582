"""Evaluation during training (`logging.eval_every`, `logging.slow_eval_every`): the final
evaluation's figures on the same held-out batches at a cadence, as `eval/...` in
history.json and in the run's wandb files; the slow tier's plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import leet, load_json, ok, pdecomp, wandb_run_dirs


def evaluated_steps(run_dir: Path, key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in load_json(run_dir / "history.json") if key in h}


def test_a_toy_run_evaluates_at_its_cadence(env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ok(pdecomp(["+experiment=tms_5-2", "optim.steps=100", "logging.log_every=30",
                "logging.eval_every=25", "logging.slow_eval_every=50", "logging.plots=false",
                "logging.wandb.mode=disabled", "logging.progress=false",
                f"hydra.run.dir={run_dir}"], tmp_path, env))
    mmcs = evaluated_steps(run_dir, "eval/mmcs/linear1")
    assert sorted(mmcs) == [25, 50, 75, 100]
    summary = load_json(run_dir / "summary.json")
    assert mmcs[100] == pytest.approx(summary["mmcs/linear1"])  # the same batches at the end
    assert sorted(p.parent.name for p in (run_dir / "eval").glob("*/ci_distribution.png")) \
        == ["100", "50"]
    history = load_json(run_dir / "history.json")
    assert all("perf/step_s" in h for h in history if h["step"] in (30, 60, 90))


def test_evaluation_in_the_loop_without_held_out_batches_is_refused(
        env: dict[str, str], tmp_path: Path) -> None:
    proc = pdecomp(["+experiment=tms_5-2", "logging.eval_every=10", "data.eval_batches=0",
                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env)
    assert proc.returncode == 2 and "data.eval_batches" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a llama_tiny run: most of a minute of compiling and training
def test_a_language_model_run_logs_the_fresh_adversary_at_each_evaluation(
        env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ok(pdecomp(["+experiment=llama_tiny_chunkwise", "model.train_steps=0", "optim.steps=200",
                "layers.sites=[layers.1.mlp.gate_proj,layers.1.mlp.up_proj]",
                "loss.recon.chunkwise.sites_per_chunk=2",
                "optim.faith_warmup_steps=5", "logging.log_every=50", "logging.eval_every=50",
                "data.eval_batches=1", "logging.progress=false", "logging.plots=false",
                f"hydra.run.dir={run_dir}"], tmp_path, env, timeout=900))
    probe = evaluated_steps(run_dir, "eval/kl/pgd")
    assert sorted(probe) == [50, 100, 150, 200]
    assert all(v > 0 for v in probe.values())
    zero = evaluated_steps(run_dir, "eval/kl/zero")
    assert len(set(zero.values())) == 1  # the same held-out batches every time
    (wb,) = wandb_run_dirs(run_dir)
    logged = {}
    for line in leet(["--json", str(wb)]).splitlines():
        record = json.loads(line)
        item = (record.get("history") or {}).get("item") or {}
        if "eval/kl/pgd" in item:
            logged[item["_step"]] = item["eval/kl/pgd"]
    assert logged == pytest.approx(probe)

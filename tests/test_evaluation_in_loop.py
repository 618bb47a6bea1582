"""Evaluation during training (`logging.eval_every`, `logging.slow_eval_every`): the final
evaluation's figures on the same held-out batches at a cadence, as `eval/...` in
history.json and in the run's wandb files; the slow tier's plots. A toy's cadence, wandb
files and gate are checked on test_cli_journeys' run with overrides in every group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import leet, load_json, ok, pdecomp, wandb_run_dirs

from pdecomp.core.config import ConfigError, EvalPGDConfig


def evaluated_steps(run_dir: Path, key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in load_json(run_dir / "history.json") if key in h}


def test_evaluation_in_the_loop_without_held_out_batches_is_refused(
        env: dict[str, str], tmp_path: Path) -> None:
    proc = pdecomp(["+experiment=tms_5-2", "logging.eval_every=10", "data.eval_batches=0",
                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env)
    assert proc.returncode == 2 and "data.eval_batches" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


def test_the_fresh_adversary_curve_doubles_from_n_steps_to_curve_to() -> None:
    assert EvalPGDConfig(20, curve_to=160).marks == (20, 40, 80, 160)  # VPD's
    assert EvalPGDConfig(20, curve_to=100).marks == (20, 40, 80)
    assert EvalPGDConfig(20).marks == () and EvalPGDConfig(0, curve_to=160).marks == ()
    import dataclasses as dc

    from test_lm import tiny_cfg

    from pdecomp.plan.validation import validate

    cfg = tiny_cfg()
    with pytest.raises(ConfigError) as e:
        validate(dc.replace(cfg, loss=dc.replace(cfg.loss, eval_pgd=EvalPGDConfig(
            20, curve_to=10))))
    assert e.value.key == "loss.eval_pgd.curve_to"


@pytest.mark.slow  # a llama_tiny run: most of a minute of compiling and training
def test_a_language_model_run_logs_the_fresh_adversary_at_each_evaluation(
        env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ok(pdecomp(["+experiment=llama_tiny_chunkwise", "model.train_steps=0", "optim.steps=200",
                "layers.sites=[layers.1.mlp.gate_proj,layers.1.mlp.up_proj]",
                "loss.recon.chunkwise.sites_per_chunk=2",
                "optim.faith_warmup_steps=5", "logging.log_every=50", "logging.eval_every=50",
                "loss.eval_pgd.n_steps=10", "loss.eval_pgd.curve_to=40",
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
    # the final evaluation's curve: one fresh adversary after 10, 20 and 40 ascents
    summary = load_json(run_dir / "summary.json")
    curve = [summary[f"kl/pgd_{n}"] for n in (10, 20, 40)]
    assert curve[0] > 0 and curve[2] >= curve[0] * 0.99, curve
    assert not any(k.startswith("eval/kl/pgd_") for h in load_json(run_dir / "history.json")
                   for k in h)  # the curve is the final evaluation's only

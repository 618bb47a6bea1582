"""End-to-end journeys through the `pdecomp` CLI: help, config, run, resume, gate, sweeps, wandb.

Each journey runs the real console script in a subprocess with a temporary working
directory. The toy target cache ($PDECOMP_CACHE) is shared across this module, so the
target trains once; wandb runs offline and keeps its files inside each run directory.
"""

from __future__ import annotations

import dataclasses as dc
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import (
    PDECOMP,
    check_sweep_wandb,
    copy_of,
    leet,
    load_json,
    ok,
    pdecomp,
    wandb_run_dirs,
)

FIXTURES = Path(__file__).parent / "fixtures" / "llama"

# Tiny runs: a few seconds of training each on a CPU.
TINY = ["optim.steps=40", "logging.log_every=10", "model.train_steps=500",
        "data.batch_size=256", "data.eval_batches=1", "optim.faith_warmup_steps=10"]
TINY_NO_BATCH = [o for o in TINY if not o.startswith("data.batch_size=")]

# One override (or more) in every config group.
ALL_GROUPS = [
    "model=tms_5-2", "model.max_retrain=5",  # max_retrain is not part of the target cache key
    "layers.C=12", "layers.ci_hidden=[8]",
    "loss.imp_min_coeff=0.002", "loss.recon.layerwise.coeff=0.5",
    "optim.components.lr=0.002", "optim.ci_fn.schedule=linear",
    "data.eval_batches=1",
    "mesh=single",
    "memory.safety_fraction=0.8",
    "gate.target=local",
    "logging.wandb.project=journeys", "logging.wandb.artifacts=true", "logging.ckpt_every=20",
    "logging.eval_every=20", "logging.slow_eval_every=40",
]
GATE_KEYS = ("peak_bytes", "argument_bytes", "temp_bytes", "cap_bytes", "fits")


@pytest.fixture(scope="module")
def full_run(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A finished tiny run with overrides in every group (the target trains here, once)."""
    cwd = tmp_path_factory.mktemp("full_run_cwd")
    run_dir = cwd / "run"
    proc = pdecomp([*TINY, *ALL_GROUPS, f"hydra.run.dir={run_dir}"], cwd, env)
    return run_dir, proc


# --- no run ----------------------------------------------------------------------------


def test_help_lists_config_groups(env: dict[str, str], tmp_path: Path) -> None:
    proc = ok(pdecomp(["--help"], tmp_path, env, timeout=120))
    out = proc.stdout
    assert "Configuration groups" in out
    for group in ("model", "layers", "loss", "optim", "data", "mesh", "memory", "gate",
                  "logging", "cluster"):
        assert any(line.startswith(f"{group}:") for line in out.splitlines()), (group, out)
    assert "tms_5-2" in out
    assert list(tmp_path.iterdir()) == []


def test_cfg_job_prints_composed_config(env: dict[str, str], tmp_path: Path) -> None:
    proc = ok(pdecomp(["--cfg", "job", "layers.C=7", "mesh=single"], tmp_path, env,
                      timeout=120))
    assert "model:" in proc.stdout and "layers:" in proc.stdout
    cfg = yaml.safe_load(proc.stdout)
    assert set(cfg) >= {"model", "layers", "loss", "optim", "data", "mesh", "memory", "gate",
                        "logging"}
    assert "hydra" not in cfg
    assert cfg["layers"]["C"] == 7 and cfg["mesh"]["name"] == "single"
    assert cfg["model"]["name"] == "tms_5-2"
    assert list(tmp_path.iterdir()) == []


def test_a_users_own_config_directory_adds_presets_and_options(env: dict[str, str],
                                                               tmp_path: Path) -> None:
    """`--config-dir DIR` and `hydra.searchpath=[...]` add a user's presets and group
    options beside pdecomp's: checked, printed and run as pdecomp's own are."""
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "layers").mkdir()
    (conf / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /layers: narrow\n"
        "optim:\n  steps: 3\n")
    (conf / "layers" / "narrow.yaml").write_text("defaults:\n  - tms\n  - _self_\nC: 7\n")
    work = tmp_path / "work"
    work.mkdir()
    printed = ok(pdecomp(["--config-dir", str(conf), "+experiment=mine", "--cfg", "job"],
                         work, env, timeout=120))
    cfg = yaml.safe_load(printed.stdout)
    assert cfg["layers"]["C"] == 7 and cfg["optim"]["steps"] == 3
    missing = ok(pdecomp(["--config-dir", str(conf), "+experiment=mine", "layers.C=???",
                          "--cfg", "job"], work, env, timeout=120))
    assert yaml.safe_load(missing.stdout)["layers"]["C"] == "???"
    run_dir = tmp_path / "run"
    ok(pdecomp([f"hydra.searchpath=[file://{conf}]", "+experiment=mine", "gate.only=true",
                f"hydra.run.dir={run_dir}"], work, env, timeout=300))
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["layers"]["C"] == 7
    assert load_json(run_dir / "gate.json")["fits"] is True
    assert list(work.iterdir()) == []


def test_findings_table_keeps_site_names_whole_on_a_narrow_console(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from launcher import printing
    from pdecomp.core.config import ResidMLPConfig, RunConfig

    base = RunConfig()
    sites = ["layers.0.mlp_in", "layers.0.mlp_out"]
    cfg = dc.replace(base, model=ResidMLPConfig(name="resid_mlp1"),
                     layers=dc.replace(base.layers, sites=sites, C=100, tie=False))
    out = io.StringIO()
    monkeypatch.setattr(printing, "console", Console(file=out, width=80))  # a log file's width
    summary = {f"{k}/{s}": v for s in sites for k, v in (("live", 100), ("l0", 0.94))}
    printing.print_findings(cfg, {**summary, "one_to_one/layers.0.mlp_in": 100}, tmp_path)
    for site in sites:
        assert f" {site} " in out.getvalue(), out.getvalue()


# --- one run ---------------------------------------------------------------------------


@pytest.mark.jax_versions  # the one CLI run under every version
def test_run_with_overrides_in_every_group(full_run) -> None:
    run_dir, proc = full_run
    ok(proc)

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["layers"]["C"] == 12 and cfg["layers"]["ci_hidden"] == [8]
    assert cfg["loss"]["imp_min_coeff"] == 0.002
    assert cfg["loss"]["recon"]["layerwise"]["coeff"] == 0.5
    assert cfg["optim"]["steps"] == 40 and cfg["optim"]["ci_fn"]["schedule"] == "linear"
    assert cfg["data"]["batch_size"] == 256
    assert cfg["mesh"]["name"] == "single" and cfg["mesh"]["data"] == 1
    assert cfg["memory"]["safety_fraction"] == 0.8
    assert cfg["gate"]["target"] == "local"
    assert cfg["logging"]["wandb"]["project"] == "journeys"
    assert cfg["model"]["max_retrain"] == 5

    gate = load_json(run_dir / "gate.json")
    for k in GATE_KEYS:
        assert k in gate, k
    assert gate["fits"] is True and 0 < gate["peak_bytes"] <= gate["cap_bytes"]
    assert gate["mesh"] == {"data": 1, "model": 1}

    summary = load_json(run_dir / "summary.json")
    for k in ("live/linear1", "live/linear2", "mmcs/linear1", "mmcs/linear2", "loss/total",
              "loss/imp_min", "loss/recon_full"):
        assert k in summary, (k, sorted(summary))
    assert summary["steps"] == 40
    assert 0 <= summary["live/linear1"] <= 12
    # the gate's forecast of a step beside the steps' measured time (a 2-core host's steps
    # of a few ms: the loop's own work between them counts, the ratio well under 10)
    forecast_s = gate["step"]["forecast"]["s_per_step"]
    logged = [h for h in load_json(run_dir / "history.json") if "perf/step_s" in h]
    assert {h["perf/forecast_step_s"] for h in logged} == {forecast_s}
    assert 0.05 < summary["perf/forecast_over_measured"] < 10
    assert 0.0 < summary["mmcs/linear1"] <= 1.0 + 1e-6

    png = run_dir / "mean_ci.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "wandb").is_dir()
    wb = wandb_run_dirs(run_dir)
    assert len(wb) == 1 and list(wb[0].glob("run-*.wandb")), list((run_dir / "wandb").iterdir())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["20", "40"]
    assert "what SPD found" in proc.stderr
    # stderr is a pipe here, as in a SLURM log: plain progress lines instead of a live bar
    steps = [line.split("step ")[1].split(",")[0] for line in proc.stderr.splitlines()
             if line.startswith("tms_5-2: step ")]
    assert steps[-1] == "40/40" and len(steps) >= 20, proc.stderr


def evaluated_steps(run_dir: Path, key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in load_json(run_dir / "history.json") if key in h}


def test_the_run_evaluates_in_the_loop_and_its_gate_compiled_the_evaluation(
        full_run, env: dict[str, str], tmp_path: Path) -> None:
    """`logging.eval_every=20`, `slow_eval_every=40`: the final evaluation's figures on the
    same held-out batches as `eval/...` at steps 20 and 40, in history.json and in the run's
    wandb files, the slow tier's CI histogram at 40; the gate compiled the evaluation's
    program beside the step, and a cap between the two peaks refuses the larger one."""
    run_dir, _ = full_run
    mmcs = evaluated_steps(run_dir, "eval/mmcs/linear1")
    assert sorted(mmcs) == [20, 40]
    assert mmcs[40] == pytest.approx(load_json(run_dir / "summary.json")["mmcs/linear1"])
    assert [p.parent.name for p in (run_dir / "eval").glob("*/ci_distribution.png")] == ["40"]
    (wb,) = wandb_run_dirs(run_dir)
    logged = {}
    for line in leet(["--json", str(wb)]).splitlines():
        item = (json.loads(line).get("history") or {}).get("item") or {}
        if "eval/mmcs/linear1" in item:
            logged[item["_step"]] = item["eval/mmcs/linear1"]
    assert logged == pytest.approx(mmcs)

    gate = load_json(run_dir / "gate.json")
    step, ci = gate["programs"]["step"], gate["programs"]["eval/ci_summary"]
    parts = gate["argument_parts_bytes"]
    shared = sum(parts[k] for k in ("frozen target", "components", "ci function"))
    resident = sum(v for k, v in parts.items() if k != "batch")
    assert ci["peak_bytes"] == resident + ci["program_peak_bytes"] - shared
    assert step["peak_bytes"] == gate["peak_bytes"] and gate["fits"]
    cap_gib = (step["peak_bytes"] + ci["peak_bytes"]) / 2 / 2**30
    gated = tmp_path / "capped"
    proc = pdecomp([*TINY, *ALL_GROUPS, "gate.only=true", f"memory.hbm_cap_gib={cap_gib}",
                    f"hydra.run.dir={gated}"], tmp_path, env)
    assert proc.returncode == 3, proc.stderr[-2000:]
    over_in_eval = ci["peak_bytes"] > step["peak_bytes"]
    assert ("evaluation's eval/ci_summary program" in proc.stderr) == over_in_eval, proc.stderr
    assert load_json(gated / "gate.json")["programs"]["eval/ci_summary"]["fits"] != over_in_eval


def test_rerun_same_dir_resumes_from_checkpoint(full_run, env: dict[str, str],
                                                tmp_path: Path) -> None:
    src = full_run[0]
    run_dir = copy_of(full_run, tmp_path / "resumed")
    more = [o for o in TINY if not o.startswith("optim.steps=")] + ["optim.steps=60"]
    # Extending a run changes its schedule: allowed only when asked for.
    proc2 = ok(pdecomp([*more, *ALL_GROUPS, "optim.allow_schedule_change=true",
                        f"hydra.run.dir={run_dir}"], tmp_path, env))
    assert "resumed from checkpoint" in proc2.stdout + proc2.stderr
    assert "at step 40" in proc2.stdout + proc2.stderr
    summary = load_json(run_dir / "summary.json")
    assert summary["steps"] == 60
    # The curve continues the first attempt's: steps up to 40 kept, 50 and 60 new.
    history = load_json(run_dir / "history.json")
    assert [h["step"] for h in history] == [1, 10, 20, 30, 40, 50, 60]
    assert {"40", "60"} <= {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert (run_dir / "wandb_id.txt").read_text() == (src / "wandb_id.txt").read_text()


def test_rerun_with_other_state_shapes_exits_2_and_keeps_the_run(
        full_run, env: dict[str, str], tmp_path: Path) -> None:
    run_dir = copy_of(full_run, tmp_path / "resumed")

    def files():  # .hydra/ included: Hydra rewrites it first, the refusal puts it back
        return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*")
                if p.is_file()}

    before = files()
    other_c = [o for o in ALL_GROUPS if not o.startswith("layers.C=")] + ["layers.C=13"]
    proc2 = pdecomp([*TINY, *other_c, f"hydra.run.dir={run_dir}"], tmp_path, env)
    assert proc2.returncode == 2, proc2.stderr
    line = proc2.stderr.strip()
    assert "\n" not in line and "hydra.run.dir" in line and "step 40" in line, line
    assert "[12" in line and "[13" in line, line  # the first array whose shape differs
    after = files()
    assert after.keys() == before.keys(), after.keys() ^ before.keys()
    assert [p for p in after if after[p] != before[p]] == []


@pytest.mark.parametrize("change", [
    "optim.steps=60",  # the cosine decay stretched over more steps
    "optim.components.lr=0.004",
    "optim.ci_fn.schedule=cosine",
    "loss.p_anneal_end_frac=0.5",
])
def test_rerun_with_a_changed_schedule_exits_2_and_keeps_the_run(
        change: str, full_run, env: dict[str, str], tmp_path: Path) -> None:
    run_dir = copy_of(full_run, tmp_path / "resumed")
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    key = change.split("=")[0]
    args = [o for o in [*TINY, *ALL_GROUPS] if not o.startswith(key + "=")] + [change]
    proc = pdecomp([*args, f"hydra.run.dir={run_dir}"], tmp_path, env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}="), proc.stderr
    assert "step 40" in lines[0] and "optim.allow_schedule_change=true" in lines[0], lines[0]
    after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after.keys() == before.keys(), after.keys() ^ before.keys()
    assert [p for p in after if after[p] != before[p]] == []  # config.yaml not rewritten


@pytest.mark.slow  # whole CLI runs, alike under every jax: the full suite, not the fast tier
def test_a_non_finite_loss_says_whether_a_checkpoint_exists(full_run, env: dict[str, str],
                                                            tmp_path: Path) -> None:
    blow_up = ["optim.components.lr=1e30", "optim.ci_fn.lr=1e30"]
    lrs = ("optim.components.lr=", "optim.ci_fn.")
    args = [o for o in [*TINY, *ALL_GROUPS] if not o.startswith(lrs)] + blow_up
    fresh = pdecomp([*args, f"hydra.run.dir={tmp_path / 'fresh'}"], tmp_path, env)
    assert fresh.returncode != 0
    assert "non-finite loss at step 10:" in fresh.stderr, fresh.stderr[-3000:]  # logged: 10, 20
    assert "Traceback" not in fresh.stderr and fresh.returncode == 1
    assert "no checkpoint was written before it" in fresh.stderr
    assert "is intact" not in fresh.stderr

    run_dir = copy_of(full_run, tmp_path / "resumed")  # checkpoints at 20 and 40
    more = [o for o in args if not o.startswith("optim.steps=")] + [
        "optim.steps=60", "optim.allow_schedule_change=true"]
    resumed = pdecomp([*more, f"hydra.run.dir={run_dir}"], tmp_path, env)
    assert resumed.returncode != 0
    assert "non-finite loss at step 50:" in resumed.stderr, resumed.stderr[-3000:]
    assert f"the last checkpoint, step 40 in {run_dir / 'checkpoints'}, is intact" in " ".join(
        resumed.stderr.split()), resumed.stderr[-3000:]


@pytest.mark.slow  # whole CLI runs, alike under every jax: the full suite, not the fast tier
def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(
        full_run, env: dict[str, str], tmp_path: Path) -> None:
    run_dir = copy_of(full_run, tmp_path / "damaged")
    ckpts = run_dir / "checkpoints"

    def resume() -> str:
        proc = pdecomp([*TINY, *ALL_GROUPS, f"hydra.run.dir={run_dir}"], tmp_path, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # (orbax's abandoned reads may print "Event loop is closed" tracebacks of their own)
        assert "pdecomp" not in "".join(re.findall(r"Traceback[^\n]*\n(?:  .*\n)*",
                                                   proc.stderr)), proc.stderr[-3000:]
        assert load_json(run_dir / "summary.json")["steps"] == 40
        assert [h["step"] for h in load_json(run_dir / "history.json")][-3:] == [20, 30, 40]
        return " ".join(proc.stderr.split())

    # unreadable metadata
    (ckpts / "40" / "default" / "_METADATA").write_text("not json")
    err = resume()
    assert "checkpoint at step 40 cannot be read" in err, err[-3000:]
    assert "resumed from checkpoint at step 20" in err
    assert (ckpts / "40.unreadable" / "default" / "_METADATA").read_text() == "not json"
    assert (ckpts / "40").is_dir()  # saved again by the resumed run

    # damaged array data (the metadata intact), in the step the resumed run saved
    data = [f for f in (ckpts / "40").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert data, sorted((ckpts / "40").rglob("*"))
    for f in data:
        f.write_bytes(b"\0" * 64)
    err = resume()
    assert "checkpoint at step 40 cannot be read" in err and "moved to" in err, err[-3000:]
    assert "resumed from checkpoint at step 20" in err
    assert (ckpts / "40.unreadable.2").is_dir() and (ckpts / "40.unreadable").is_dir()


def test_gate_only_writes_report_and_no_summary(env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "gate_only"
    proc = ok(pdecomp([*TINY, "gate.only=true", f"hydra.run.dir={run_dir}"], tmp_path, env))
    gate = load_json(run_dir / "gate.json")
    for k in GATE_KEYS:
        assert k in gate, k
    assert gate["fits"] is True
    assert not (run_dir / "summary.json").exists()
    assert not (run_dir / "checkpoints").exists()
    assert "memory gate" in proc.stderr
    # every gate prints and records its forecast beside its floor
    f = gate["step"]["forecast"]
    assert f["s_per_step"] >= f["floor_s"] > 0
    assert "forecast step" in proc.stderr and "examples/s" in proc.stderr
    # a local device's gate says how many of the step's dot shapes it has measured
    assert f"{f['dots_measured']} of its {f['dots']} dot shapes measured" in proc.stderr


def test_tiny_hbm_cap_refuses_with_exit_3(env: dict[str, str], tmp_path: Path) -> None:
    run_dir = tmp_path / "refused"
    proc = pdecomp([*TINY, "memory.hbm_cap_gib=0.000001", f"hydra.run.dir={run_dir}"],
                   tmp_path, env)
    assert proc.returncode == 3, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    assert "gate refused" in proc.stderr
    gate = load_json(run_dir / "gate.json")
    assert gate["fits"] is False and gate["peak_bytes"] > gate["cap_bytes"]
    assert gate["cap_source"] == "memory.hbm_cap_gib"
    ckpts = run_dir / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())
    assert not (run_dir / "summary.json").exists()


# --- sweeps ----------------------------------------------------------------------------


def check_sweep(proc: subprocess.CompletedProcess[str], sweep_dir: Path) -> list[Path]:
    """Three jobs of batch 128, 256, 512, each in the summary; their directories."""
    ok(proc)
    assert "sweep summary" in proc.stdout, proc.stdout[-3000:]
    rows = load_json(sweep_dir / "sweep_summary.json")
    assert [r["job"] for r in rows] == [0, 1, 2]
    assert all("summary.json" in r and "gate.json" in r for r in rows)
    assert sorted(o for r in rows for o in r["overrides"] if o.startswith("data.batch_size=")) \
        == ["data.batch_size=128", "data.batch_size=256", "data.batch_size=512"]
    jobs = [Path(r["dir"]) for r in rows]
    sizes = []
    for j in jobs:
        summary = load_json(j / "summary.json")
        assert summary["steps"] == 40 and "loss/total" in summary
        sizes.append(yaml.safe_load((j / "config.yaml").read_text())["data"]["batch_size"])
    assert sorted(sizes) == [128, 256, 512]
    check_sweep_wandb(jobs, "data.batch_size")
    return jobs


@pytest.mark.slow  # whole CLI runs, alike under every jax: the full suite, not the fast tier
def test_sweep_basic_launcher(env: dict[str, str], tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = pdecomp(["-m", *TINY_NO_BATCH, "data.batch_size=128,256,512",
                    f"hydra.sweep.dir={sweep_dir}"], tmp_path, env, timeout=400)
    assert [j.name for j in check_sweep(proc, sweep_dir)] == ["0", "1", "2"]
    # Rebuilt afterwards from what the jobs wrote, the summary is the one the sweep printed.
    status = ok(pdecomp(["status", str(sweep_dir)], tmp_path, env))
    assert "sweep summary" in status.stdout and status.stdout in proc.stdout


@pytest.mark.slow
def test_sweep_submitit_local_in_directories_named_by_overrides(env: dict[str, str],
                                                                tmp_path: Path) -> None:
    """Job directories named by each job's overrides (Hydra's own recipe) instead of numbers:
    the summary still has every job."""
    sweep_dir = tmp_path / "sweep_local"
    proc = pdecomp(["-m", "cluster=local", *TINY_NO_BATCH, "data.batch_size=128,256,512",
                    "hydra.sweep.subdir=${hydra.job.override_dirname}",
                    f"hydra.sweep.dir={sweep_dir}"], tmp_path, env, timeout=900)
    jobs = check_sweep(proc, sweep_dir)
    assert all(j.parent == sweep_dir and "data.batch_size=" in j.name for j in jobs), jobs
    assert (sweep_dir / ".submitit").is_dir()


@pytest.mark.slow
def test_an_optuna_sweep_over_an_interval_reports_its_best(env: dict[str, str],
                                                          tmp_path: Path) -> None:
    """Hydra's Optuna sweeper searches an interval of loss.imp_min_coeff, each trial a run
    whose logging.objective it minimises; the sweep ends with Optuna's best and pdecomp's
    summary of every trial."""
    sweep = tmp_path / "optuna"
    proc = ok(pdecomp(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3",
                       "hydra.sweeper.sampler.seed=0", "loss.imp_min_coeff=interval(1e-4,1e-2)",
                       *TINY, "logging.objective=loss/total", f"hydra.sweep.dir={sweep}"],
                      tmp_path, env, timeout=600))
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    rows = load_json(sweep / "sweep_summary.json")
    assert [r["job"] for r in rows] == [0, 1, 2]
    losses = {float(o.split("=")[1]): r["summary.json"]["loss/total"]
              for r in rows for o in r["overrides"] if o.startswith("loss.imp_min_coeff=")}
    assert len(losses) == 3 and all(1e-4 <= c <= 1e-2 for c in losses), losses
    assert best["best_value"] == pytest.approx(min(losses.values()))
    assert losses[best["best_params"]["loss.imp_min_coeff"]] == pytest.approx(best["best_value"])
    assert "Best value" in proc.stdout + proc.stderr and "sweep summary" in proc.stdout


# --- wandb read back -------------------------------------------------------------------


def test_offline_wandb_run_reads_back(full_run) -> None:
    run_dir, proc = full_run
    ok(proc)
    (wb_dir,) = wandb_run_dirs(run_dir)

    run = json.loads(leet(["--summary", "--json", str(wb_dir)]))
    assert run["state"] == "finished" and run["exit_code"] == 0
    assert run["project"] == "journeys"
    assert run["run_id"] == (run_dir / "wandb_id.txt").read_text().strip()
    assert run["config"]["layers"]["C"] == 12 and run["config"]["mesh"]["name"] == "single"

    s = run["summary"]
    for k in ("loss/total", "loss/imp_min", "loss/recon_full", "hbm/predicted_peak_gib",
              "live/linear1", "mmcs/linear1", "steps"):
        assert k in s, (k, sorted(s))
    summary = load_json(run_dir / "summary.json")
    assert s["loss/total"] == pytest.approx(summary["loss/total"])
    assert s["steps"] == 40
    gate = load_json(run_dir / "gate.json")
    assert isinstance(s["gate"], dict)
    for k in GATE_KEYS:
        assert k in s["gate"], k
    assert s["gate"]["peak_bytes"] == gate["peak_bytes"] and s["gate"]["fits"] is True
    assert s["hbm/predicted_peak_gib"] == pytest.approx(gate["peak_bytes"] / 2**30)

    records = [json.loads(line) for line in leet(["--json", str(wb_dir)]).splitlines() if line]
    rows = {r["history"]["step"].get("num", 0): r["history"]["item"]
            for r in records if r.get("type") == "history"}
    assert sorted(rows) == [0, 1, 10, 20, 30, 40]
    assert "hbm/predicted_peak_gib" in rows[0]
    for step in (1, 10, 20, 30, 40):
        assert {"loss/total", "loss/imp_min", "loss/recon_full"} <= set(rows[step]), rows[step]
    assert rows[40]["loss/total"] == pytest.approx(summary["loss/total"])
    # the gate's forecast beside the measured step, in wandb as in the run's files
    assert rows[40]["perf/forecast_step_s"] == gate["step"]["forecast"]["s_per_step"]
    assert s["perf/forecast_over_measured"] == pytest.approx(
        summary["perf/forecast_over_measured"])
    # logging.wandb.artifacts: the final checkpoint, by reference (its files named, not read)
    (art,) = [r["artifact"] for r in records if r.get("type") == "artifact"]
    assert art["type"] == "checkpoint" and art["name"].startswith("checkpoint-")
    refs = [c["ref"] for c in art["manifest"]["contents"]]
    assert refs and all(r.startswith((run_dir / "checkpoints" / "40").as_uri()) for r in refs)


CLUSTERS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "launcher" / "conf" /
                                    "cluster").glob("*.yaml"))


# The launcher is what the printing depends on: every cluster with a toy, and a submitting
# one with presets of each kind, one leaving a path for the run (test_registries composes
# every preset in-process).
@pytest.mark.parametrize(("preset", "cluster"), [
    *((p, "slurm") for p in ("llama8b_l18-26_chunkwise", "smollm2_l28", "resid_mlp1")),
    *(("tms_40-10", c) for c in CLUSTERS)])
def test_cfg_job_prints_every_preset_with_every_cluster(preset: str, cluster: str,
                                                       env: dict[str, str],
                                                       tmp_path: Path) -> None:
    """Hydra's own flags work whatever the preset and the launcher: a submitting launcher no
    longer turns the command into a sweep Hydra refuses beside --cfg, and a value the preset
    leaves for the run (a data.path) is printed, not refused: checks are for runs."""
    proc = ok(pdecomp([f"cluster={cluster}", f"+experiment={preset}", "--cfg", "job"],
                      tmp_path, env, timeout=120))
    assert "model" in yaml.safe_load(proc.stdout)
    assert not list(tmp_path.iterdir())  # printing makes no directory
    if preset != "tms_40-10":
        return
    # with every cluster: one package of it, resolved; the launcher's own settings
    layers = ok(pdecomp([f"cluster={cluster}", f"+experiment={preset}", "--cfg", "job",
                         "-p", "layers", "--resolve"], tmp_path, env, timeout=120))
    assert "${" not in layers.stdout and yaml.safe_load(layers.stdout)["sites"]
    launcher = ok(pdecomp([f"cluster={cluster}", f"+experiment={preset}", "--cfg", "hydra",
                           "-p", "hydra.launcher"], tmp_path, env, timeout=120))
    assert "_target_" in yaml.safe_load(launcher.stdout)
    assert not list(tmp_path.iterdir())  # printing makes no directory


@pytest.mark.parametrize(("args", "line"), [
    ([], "usage: pdecomp resume <run dir> [overrides ...]"),
    (["{tmp}/nowhere"], "{tmp}/nowhere: not a run directory pdecomp made (does not exist)"),
    (["{tmp}"], "{tmp}: not a run directory pdecomp made (has no .hydra/overrides.yaml)"),
])
def test_resume_of_no_run_exits_2_with_one_line(args: list[str], line: str,
                                                env: dict[str, str], tmp_path: Path) -> None:
    proc = pdecomp(["resume", *(a.format(tmp=tmp_path) for a in args)], tmp_path, env)
    assert proc.returncode == 2 and proc.stderr.strip() == line.format(tmp=tmp_path), proc.stderr
    assert not list(tmp_path.iterdir())


def test_version_is_pdecomps(env: dict[str, str], tmp_path: Path) -> None:
    line = ok(pdecomp(["--version"], tmp_path, env, timeout=120)).stdout.strip()
    assert re.fullmatch(r"pdecomp \S+ \(commit [0-9a-f]{40}(-dirty)?; jax \S+, Python \S+\)",
                        line), line


def test_mesh_larger_than_the_jobs_devices_exits_2(tmp_path: Path, env: dict[str, str]) -> None:
    """Only the job knows its devices: the check runs there and still ends with exit 2."""
    proc = pdecomp([*TINY, "mesh.data=64", "logging.progress=false", "logging.wandb.mode=disabled"],
                   tmp_path, env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("config error: mesh.data=64")


# --- deviceless GPU gate -----------------------------------------------------------------


def test_deviceless_gate_for_64_b200s(tmp_path: Path, env: dict[str, str]) -> None:
    """Journey 2: the memory table for 8 hosts x 8 B200s, on a machine without a GPU."""
    run_dir = tmp_path / "b200"
    proc = ok(pdecomp(["gate.only=true", "gate.target=b200", "mesh=fsdp64",
                       f"hydra.run.dir={run_dir}"], tmp_path, env))
    gate = load_json(run_dir / "gate.json")
    assert gate["n_devices"] == 64 and gate["mesh"] == {"data": 64, "model": 1}
    assert gate["target"] == "deviceless NVIDIA B200 x 64 (8 hosts)"
    assert gate["fits"] and gate["largest_temps"]
    for text in ("memory gate", "NVIDIA B200 x 64", "largest temporaries"):
        assert text in proc.stderr, proc.stderr[-3000:]
    for noise in ("cudart_stub", "Could not find cuda drivers", "Unable to load CUDA"):
        assert noise not in proc.stderr  # the compile plugin loads quietly
    assert not (run_dir / "checkpoints").exists()


def test_a_job_given_gpus_jax_does_not_see_exits_2(tmp_path: Path, env: dict[str, str]) -> None:
    """Installed without jax's CUDA plugin, a GPU job would train on the CPU: it stops at
    its start instead, saying what to install (submitit's local executor stands in for
    a GPU node's scheduler)."""
    sweep = tmp_path / "sweep"
    proc = pdecomp(["cluster=local", "hydra.launcher.gpus_per_node=1", "gate.only=true",
                    f"hydra.sweep.dir={sweep}"], tmp_path, env)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    (row,) = load_json(sweep / "sweep_summary.json")
    why = row["outcome"]
    assert why["exit_code"] == 2 and "hydra.launcher.gpus_per_node=1" in why["reason"]
    assert "make install-gpu" in why["reason"] and not (sweep / "0" / "gate.json").exists()


@pytest.mark.parametrize(("args", "key", "plugin"), [
    (["gate.target=h100"], "gate.target='h100'", None),  # a GPU this job lacks: gate only
    (["mesh=fsdp8"], "mesh.gpus_per_host=8", None),  # 8 devices planned, 2 at hand
    (["gate.target=b200", "gate.only=true"], "gate.target='b200'", "missing"),  # no plugin
    (["+experiment=llama_tiny_chunkwise", "data=tokens", "data.path=missing.u32"],
     "data.path='missing.u32'", None),  # the token file is opened before anything is made
    (["+experiment=llama_tiny_chunkwise", "model.path={incomplete}",
      "layers.sites=[layers.1.mlp.up_proj]", "loss.recon.chunkwise.sites_per_chunk=1"],
     "model.path=", None),  # a shard is missing
])
def test_job_side_config_errors_exit_2_and_leave_nothing(tmp_path: Path, env: dict[str, str],
                                                          args: list[str], key: str,
                                                          plugin: str | None) -> None:
    run_dir = tmp_path / "run"
    incomplete = tmp_path / "incomplete"  # a HF directory whose index names a missing shard
    shutil.copytree(FIXTURES / "tied_sharded", incomplete)
    next(incomplete.glob("model-0000*.safetensors")).unlink()
    args = [a.format(incomplete=incomplete) for a in args]
    job_env = dict(env, PDECOMP_CPU_DEVICES="2")
    if plugin:
        job_env["PDECOMP_GPU_COMPILE_DIR"] = str(tmp_path / plugin)
    proc = pdecomp([*TINY, *args, f"hydra.run.dir={run_dir}"], tmp_path, job_env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"config error: {key}"), last
    assert not run_dir.exists()


def _in_hub_cache(cache: Path, repo: str, src: Path) -> Path:
    """`src` laid out as huggingface_hub's cache holds a downloaded repository; its snapshot."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    shutil.copytree(src, folder / "snapshots" / commit, ignore=shutil.ignore_patterns("*.npy"))
    return folder / "snapshots" / commit


def test_a_hub_id_resolves_from_the_hub_cache_offline(tmp_path: Path) -> None:
    """model.path=org/name reads the hub cache's snapshot, with no network (HF_HUB_OFFLINE);
    the run records the snapshot it read. An id the cache lacks exits 2 with the command
    that fetches it, leaving nothing behind."""
    snap = _in_hub_cache(tmp_path / "hub", "pdecomp-tests/gqa-llama3", FIXTURES / "gqa_llama3")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "disabled"}
    cwd, run_dir = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    sites = "layers.sites=[layers.1.mlp.gate_proj,layers.1.mlp.up_proj,layers.1.mlp.down_proj]"
    args = [PDECOMP, "+experiment=llama_tiny_chunkwise", sites, "gate.only=true"]
    proc = subprocess.run([*args, "model.path=pdecomp-tests/gqa-llama3",
                           f"hydra.run.dir={run_dir}"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((run_dir / "run.json").read_text())["config"]
    assert record["model"]["path"] == str(snap) and record["name"] == "gqa-llama3"
    proc = subprocess.run([*args, "model.path=pdecomp-tests/absent"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "model.path='pdecomp-tests/absent'" in lines[0], lines[0]
    assert "hf download pdecomp-tests/absent" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert list(cwd.iterdir()) == []

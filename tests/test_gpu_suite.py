"""bench/gpu_suite.py at CPU size (`--reduced`): the GPU suite's speed and quality phases run
end to end and write what bench/RESULTS.md's GPU tables are made from. The reference's rows
need torch and a checkout of it, which this machine has not: the speed phase runs without
them and says so by their absence."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SUITE = ROOT / "bench" / "gpu_suite.py"
pytestmark = pytest.mark.slow


def suite(phase: str, out: Path, env: dict[str, str], *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(SUITE), phase, "--reduced", "--out", str(out),
                           *args], capture_output=True, text=True, env={**env,
                                                                        "JAX_PLATFORMS": "cpu"},
                          check=False, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads((out / f"{phase}.json").read_text())


def test_speed_phase_times_the_job_and_reads_the_gate(tmp_path, env):
    result = suite("speed", tmp_path / "out", env)
    assert set(result["matmul_peak_tflops"]) == {"bfloat16", "float32"}
    (key, row), = result["rows"].items()
    assert key == "2x32/bfloat16" and "reference" not in row  # no checkout given
    pd = row["pdecomp"]
    assert pd["step_s"] > 0 and pd["tokens_per_s"] == pytest.approx(64 / pd["step_s"])
    assert pd["predicted_peak_bytes"] > 0 and pd["matmul_flops"] > 0


def test_quality_phase_reports_as_vpd_does(tmp_path, env):
    out = tmp_path / "out"
    result = suite("quality", out, env, "--steps", "3", "--curve-batches", "1")
    summary, curve = result["summary"], result["fresh_pgd"]
    assert result["steps"] == 3 and "error" not in result["run"]
    # the recipe: 6 MLP sites, persistent PGD per example, the CI function's clip
    over = result["overrides"]
    assert "loss.pgd.scope=per_token" in over and "optim.ci_fn.clip_norm=1.0" in over
    assert sum(k.startswith("l0/") for k in summary) == 6
    assert set(curve) == {f"{s}/{n}" for s in ("shared", "per_token") for n in (2, 4)}
    assert all(math.isfinite(v["kl"]) and v["kl"] >= 0 for v in curve.values())
    table = "\n".join(result["table"])
    for kind in ("target", "unmasked", "stochastic", "rounded", "ci", "zero"):
        assert f"| {kind} |" in table
    assert "KL / zero-ablation KL" in table and "live components" in table
    assert (out / "quality_history.png").stat().st_size > 0


def test_kernel_times_puts_each_kernel_beside_its_forecast(tmp_path, env):
    """bench/kernel_times.py (the suite's `kernels` phase) on the TMS step, on this CPU: the
    profile's events are found by the kernels' names, and the dots and the rest are summed
    apart, each kernel's forecast beside its measured seconds."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_times.py"), "--top",
                           "5", "--job", "tms_5-2", "3"], capture_output=True, text=True,
                          env={**env, "JAX_PLATFORMS": "cpu"}, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["seconds"]) == 3 and out["kernels_seen"] > out["kernels"] // 2
    assert out["dots_measured_s"] > 0 and out["other_measured_s"] > 0
    assert 0 < out["busy_s"] <= out["dots_measured_s"] + out["other_measured_s"] + 1e-9
    assert out["busy_s"] <= max(out["seconds"])  # the kernels ran within the steps
    assert len(out["top"]) == 5 and all(r["forecast_s"] > 0 for r in out["top"])
    kinds = out["by_kind"]
    assert {"matmul", "rows < 32 wide"} <= set(kinds)  # TMS 5-2's [4096, 5] loops
    assert sum(k["measured_s"] for k in kinds.values()) == pytest.approx(
        out["dots_measured_s"] + out["other_measured_s"])
    assert sum(out["per_kernel_s"].values()) == pytest.approx(
        out["dots_measured_s"] + out["other_measured_s"], rel=1e-4)
    first = tmp_path / "first.json"
    first.write_text(proc.stdout)
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_times.py"), "--top",
                            "1", "--job", "tms_5-2", "--packed", str(first), "2"],
                           capture_output=True, text=True,
                           env={**env, "JAX_PLATFORMS": "cpu"}, check=False, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    packed = json.loads(again.stdout.strip().splitlines()[-1])["packed"]
    cores = packed["cores"]  # the first run's kernels, spread over this process's cores
    total = sum(out["per_kernel_s"].values())
    assert total / cores * (1 - 1e-6) <= packed["s"] <= total * (1 + 1e-6)
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_times.py"), "--job",
                          "nope", "3"], capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 2 and "--job: one of" in bad.stderr

"""One usable-memory setting for a GPU: the gate's cap and the job's allocator both follow
it (memory.safety_fraction, exported as XLA_CLIENT_MEM_FRACTION, or the user's own)."""

from __future__ import annotations

import dataclasses as dc
from pathlib import Path

import pytest
from conftest import gate_report, load_json, ok, pdecomp

from pdecomp.core import hardware
from pdecomp.core.config import ConfigError, RunConfig
from pdecomp.gate.report import rows as report_rows
from pdecomp.gate.step import gate_cap
from pdecomp.plan.resolve import resolve

pytestmark = pytest.mark.jax_versions  # the deviceless caps come from the compiled figures

# Every SLURM task runs launcher.job.run_job with an environment like this one.
SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "8",
             "SLURM_JOB_NODELIST": "gpu[01-02]", "PATH": "/usr/bin"}


@pytest.fixture(autouse=True)
def fresh_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process: nothing exported, no allocator variable set."""
    monkeypatch.setattr(hardware, "_exported", {})
    for var in hardware.MEMORY_VARS:
        monkeypatch.delenv(var, raising=False)


def deviceless(gpu: str, **memory) -> RunConfig:
    cfg = RunConfig()
    return dc.replace(cfg, memory=dc.replace(cfg.memory, **memory),
                      gate=dc.replace(cfg.gate, only=True, target=gpu))


def test_a_slurm_task_exports_the_fraction_the_gate_caps_at() -> None:
    environ = dict(SLURM_ENV)
    assert hardware.export_job_memory(0.85, environ) == {"XLA_CLIENT_MEM_FRACTION": "0.85"}
    assert environ == {**SLURM_ENV, "XLA_CLIENT_MEM_FRACTION": "0.85"}
    usable = hardware.usable_memory(0.85, environ)  # what the job's own gate then reads
    assert (usable.fraction, usable.source) == (0.85, "memory.safety_fraction")
    assert usable.export == {"XLA_CLIENT_MEM_FRACTION": "0.85"} and usable.pooled
    # a second job of the same process (an in-process sweep) exports its own
    assert hardware.export_job_memory(0.7, environ) == {"XLA_CLIENT_MEM_FRACTION": "0.7"}
    assert hardware.usable_memory(0.7, environ).fraction == 0.7


@pytest.mark.parametrize("var", hardware.MEM_FRACTION_VARS)
def test_a_fraction_of_the_users_is_kept_and_is_the_caps(var: str) -> None:
    environ = {**SLURM_ENV, var: ".6"}
    assert hardware.export_job_memory(0.9, environ) == {}
    assert environ == {**SLURM_ENV, var: ".6"}
    usable = hardware.usable_memory(0.9, environ)
    assert (usable.fraction, usable.source, usable.export) == (0.6, var, {})
    assert usable.describe() == f"from {var}, which the job keeps"


@pytest.mark.parametrize(("gpu", "fraction"), [("h100", 0.9), ("b200", 0.9), ("b200", 0.5)])
def test_the_deviceless_cap_is_the_card_times_what_the_job_exports(gpu: str,
                                                                   fraction: float) -> None:
    cap, source, record = gate_cap(resolve(deviceless(gpu, safety_fraction=fraction)), mesh=None)
    exported = hardware.export_job_memory(fraction, dict(SLURM_ENV))
    assert cap == int(hardware.GPUS[gpu].memory_bytes * float(exported["XLA_CLIENT_MEM_FRACTION"]))
    assert source.endswith(f"memory.safety_fraction, which the job exports as "
                           f"XLA_CLIENT_MEM_FRACTION={fraction}")
    assert record["job_exports"] == exported and record["source"] == "memory.safety_fraction"


def test_a_users_fraction_changes_the_deviceless_cap_and_the_report_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    cap, source, record = gate_cap(resolve(deviceless("h100")), mesh=None)
    assert cap == int(hardware.GPUS["h100"].memory_bytes * 0.75)
    assert record["fraction"] == 0.75 and record["job_exports"] == {}
    rows = dict(report_rows(gate_report(cap_bytes=cap, cap_source=source, memory_env=record)))
    assert "x 0.75" in rows["cap"] and "from XLA_PYTHON_CLIENT_MEM_FRACTION" in rows["cap"]


def test_allocator_settings_say_what_the_cap_means() -> None:
    platform = hardware.usable_memory(0.9, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    assert not platform.pooled and "not enforced" in platform.note
    grows = hardware.usable_memory(0.9, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert grows.pooled and "as needed" in grows.note and grows.fraction == 0.9
    assert hardware.usable_memory(0.9, {}).note == ""


@pytest.mark.parametrize(("environ", "key"), [
    ({"XLA_CLIENT_MEM_FRACTION": "0.8", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.7"},
     "XLA_PYTHON_CLIENT_MEM_FRACTION"),  # jax refuses both
    ({"XLA_CLIENT_MEM_FRACTION": "most"}, "XLA_CLIENT_MEM_FRACTION"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"}, "XLA_PYTHON_CLIENT_MEM_FRACTION"),
])
def test_a_bad_allocator_setting_is_a_config_error(environ: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=f"config error: {key}="):
        hardware.usable_memory(0.9, environ)


@pytest.mark.parametrize(("user", "fraction"), [(None, 0.9), ("0.5", 0.5)])
def test_cli_job_exports_what_its_deviceless_gate_caps_at(
        tmp_path: Path, env: dict[str, str], user: str | None, fraction: float) -> None:
    """The job process (launcher.job.run_job, what every SLURM task runs) has the fraction
    in its environment that its gate capped at."""
    run_dir = tmp_path / "h100"
    environ = {k: v for k, v in env.items() if k not in hardware.MEMORY_VARS}
    if user:
        environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = user
    ok(pdecomp(["gate.only=true", "gate.target=h100", "logging.wandb.mode=disabled",
                f"hydra.run.dir={run_dir}"], tmp_path, environ))
    gate = load_json(run_dir / "gate.json")
    assert gate["cap_bytes"] == int(hardware.GPUS["h100"].memory_bytes * fraction)
    memory_env = gate["memory_env"]
    assert memory_env["fraction"] == fraction
    if user:
        assert memory_env["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == user
        assert memory_env["env"]["XLA_CLIENT_MEM_FRACTION"] is None  # jax refuses both
        assert "from XLA_PYTHON_CLIENT_MEM_FRACTION" in gate["cap_source"]
    else:
        assert memory_env["env"]["XLA_CLIENT_MEM_FRACTION"] == str(fraction)


def test_cli_bad_fraction_exits_2_with_one_line(tmp_path: Path, env: dict[str, str]) -> None:
    proc = pdecomp(["gate.only=true", "gate.target=h100", "logging.wandb.mode=disabled",
                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                   {**env, "XLA_CLIENT_MEM_FRACTION": "most"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "config error: XLA_CLIENT_MEM_FRACTION='most'")
    assert not (tmp_path / "run").exists()

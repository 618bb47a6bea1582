"""The local memory gate: the report's figures, refusal before any state, one compile."""

from __future__ import annotations

import dataclasses as dc
import json
import logging

import jax
import pytest

from pdecomp.config import RunConfig
from pdecomp.gate import tree_bytes
from pdecomp.run import GateRefused, decompose


def _cfg(tmp_path, **memory):
    base = RunConfig()
    return dc.replace(
        base,
        model=dc.replace(base.model, cache_dir=str(tmp_path / "cache"), train_steps=500),
        optim=dc.replace(base.optim, steps=20, faith_warmup_steps=5),
        data=dc.replace(base.data, batch_size=256, eval_batches=1),
        memory=dc.replace(base.memory, **memory),
        logging=dc.replace(base.logging, log_every=10, plots=False))


def test_report_fields_and_argument_bytes(tmp_path):
    cfg = dc.replace(_cfg(tmp_path), gate=dc.replace(RunConfig().gate, only=True))
    out = decompose(cfg, tmp_path / "run")
    report = json.loads((tmp_path / "run" / "gate.json").read_text())
    assert out["gate"] == report
    assert report["peak_bytes"] == (report["temp_bytes"] + report["argument_bytes"]
                                    + report["output_bytes"] - report["alias_bytes"])
    # argument bytes = state + target + batch, counted independently from the shapes
    parts = report["argument_parts_bytes"]
    assert report["argument_bytes"] == sum(parts.values())
    assert parts["batch"] == 256 * 5 * 4
    assert parts["components"] == (5 * 20 + 20 * 2) * 4  # linear2 is tied: owns nothing
    assert report["fits"] and report["n_devices"] == len(jax.devices())
    assert not (tmp_path / "run" / "checkpoints").exists()  # gate only: nothing trained


def test_over_cap_run_is_refused_before_any_state_exists(tmp_path):
    cfg = _cfg(tmp_path, hbm_cap_gib=1e-6)
    with pytest.raises(GateRefused) as e:
        decompose(cfg, tmp_path / "run")
    assert not e.value.report["fits"]
    assert json.loads((tmp_path / "run" / "gate.json").read_text())["fits"] is False
    assert not (tmp_path / "run" / "checkpoints").exists()
    # no train state was made: no array with the shape of V [5, 20] or U [20, 2] exists
    assert not [a for a in jax.live_arrays() if a.shape in ((5, 20), (20, 2))]


def test_training_runs_the_gated_executable_without_recompiling(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    decompose(cfg, tmp_path / "warm")  # train and cache the target first
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING, logger="jax"):
            decompose(dc.replace(cfg, seed=1), tmp_path / "run")
    finally:
        jax.config.update("jax_log_compiles", False)
    step_compiles = [r for r in caplog.records
                     if r.getMessage().startswith("Compiling jit(train_step)")]
    assert len(step_compiles) == 1, [r.getMessage() for r in step_compiles]


def test_tree_bytes_counts_per_shard():
    x = jax.ShapeDtypeStruct((8, 4), jax.numpy.float32)
    assert tree_bytes({"a": x}) == 128 and tree_bytes({"a": x}, 8) == 16

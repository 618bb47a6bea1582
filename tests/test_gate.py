"""The local memory gate: the report's figures, refusal before any state, one compile."""

from __future__ import annotations

import dataclasses as dc
import json
import logging
import math
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from pdecomp.core.config import ConfigError, RunConfig
from pdecomp.gate import compiled as gate
from pdecomp.gate import xla_dump
from pdecomp.gate.compiled import tree_bytes
from pdecomp.run.decompose import GateRefused, Hooks, decompose


def _cfg(tmp_path, **memory):
    base = RunConfig()
    return dc.replace(
        base,
        model=dc.replace(base.model, cache_dir=str(tmp_path / "cache"), train_steps=500),
        optim=dc.replace(base.optim, steps=20, faith_warmup_steps=5),
        data=dc.replace(base.data, batch_size=256, eval_batches=1),
        memory=dc.replace(base.memory, **memory),
        logging=dc.replace(base.logging, log_every=10, plots=False))


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
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
    # the forecast, from this CPU's calibration: every part of it, never below its floor
    f = report["step"]["forecast"]
    assert f["s_per_step"] >= f["floor_s"] > 0
    assert f["calibration"]["source"].startswith("measured")
    assert f["s_per_step"] == pytest.approx(sum(f["breakdown_s"].values()))
    assert f["kernels"] > 0 and "tokens_per_s" not in f  # a toy's inputs are not tokens


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
def test_over_cap_run_is_refused_before_any_state_exists(tmp_path):
    cfg = _cfg(tmp_path, hbm_cap_gib=1e-6)
    with pytest.raises(GateRefused) as e:
        decompose(cfg, tmp_path / "run")
    assert not e.value.report.fits
    assert json.loads((tmp_path / "run" / "gate.json").read_text())["fits"] is False
    assert not (tmp_path / "run" / "checkpoints").exists()
    # no train state was made: no array with the shape of V [5, 20] or U [20, 2] exists
    assert not [a for a in jax.live_arrays() if a.shape in ((5, 20), (20, 2))]


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
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
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x = jax.ShapeDtypeStruct((8, 4), jax.numpy.float32, sharding=NamedSharding(mesh, P("data")))
    assert tree_bytes({"a": x, "b": jax.ShapeDtypeStruct((3,), jax.numpy.int8)}) == 128 + 3


# Gate-only on 1 or 8 simulated CPU devices (a fresh process: the device count is fixed at
# start). The residual MLP's dims are all divisible by 8, so with shard_state every leaf but
# the scalars and the PRNG key is split 8 ways.
ARG_BYTES_SCRIPT = textwrap.dedent("""
    import dataclasses as dc, json, sys
    import jax
    from pdecomp.core.config import ResidMLPConfig, RunConfig
    from pdecomp.run.decompose import decompose
    from pdecomp.kinds.cache import init_target
    from pdecomp.plan.resolve import resolve
    from pdecomp.spd.step import init_state

    base = RunConfig()
    cfg = dc.replace(base,
        model=ResidMLPConfig(name="rm", n_features=16, d_embed=64, d_hidden=32),
        layers=dc.replace(base.layers, sites=["layers.0.mlp_in", "layers.0.mlp_out"], C=16),
        data=dc.replace(base.data, batch_size=256),
        mesh=dc.replace(base.mesh, shard_state=True),
        gate=dc.replace(base.gate, only=True, top_temps=3))
    report = decompose(cfg, sys.argv[1])["gate"]
    key = jax.random.PRNGKey(0)
    target = jax.eval_shape(lambda k: init_target(k, cfg.model), key)
    spec = resolve(cfg).step
    state = jax.eval_shape(lambda k, t: init_state(k, spec, t), key, target)
    leaves = [(list(x.shape), x.dtype.itemsize) for x in jax.tree.leaves((state, target))]
    print(json.dumps({"report": report, "leaves": leaves, "n": len(jax.devices())}))
""")


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
@pytest.mark.parametrize("n_devices", [1, 8])
def test_argument_bytes_match_an_independent_count(tmp_path, n_devices):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n_devices}")
    out = subprocess.run([sys.executable, "-c", ARG_BYTES_SCRIPT, str(tmp_path)], env=env,
                         capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    report, n = got["report"], got["n"]
    assert n == n_devices and report["n_devices"] == n_devices
    expected = 256 * 16 * 4 // n  # the batch, split on the data axis
    for shape, itemsize in got["leaves"]:
        size = math.prod(shape) * itemsize
        expected += size // n if any(d % n == 0 and d >= n for d in shape) else size
    assert report["argument_bytes"] == expected  # XLA's own figure, per device
    assert sum(report["argument_parts_bytes"].values()) == expected
    assert report["largest_temps"] and report["largest_temps"][0]["source"]


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
@pytest.mark.parametrize(("gpu", "hosts", "per_host", "gib"),
                         [("h100", 1, 1, 79.1), ("h200", 1, 8, 141.0), ("b200", 8, 8, 178.4)])
def test_deviceless_gpu_targets(tmp_path, gpu, hosts, per_host, gib):
    cfg = _cfg(tmp_path)
    cfg = dc.replace(cfg, data=dc.replace(cfg.data, batch_size=4096),
                     mesh=dc.replace(cfg.mesh, hosts=hosts, gpus_per_host=per_host,
                                     shard_state=True),
                     gate=dc.replace(cfg.gate, only=True, target=gpu, top_temps=2))
    report = decompose(cfg, tmp_path / "run")["gate"]
    n = hosts * per_host
    assert report["n_devices"] == n and report["mesh"] == {"data": n, "model": 1}
    assert report["target"].startswith("deviceless NVIDIA " + gpu.upper())
    assert f"x {n} ({hosts} host" in report["target"]
    assert abs(report["cap_bytes"] / 0.9 / 2**30 - gib) < 0.1  # the card's own memory
    assert report["argument_parts_bytes"]["batch"] == 4096 * 5 * 4 // n
    assert report["fits"] and report["temp_bytes"] > 0
    assert report["peak_bytes"] == (report["temp_bytes"] + report["argument_bytes"]
                                    + report["output_bytes"] - report["alias_bytes"])
    assert jax.default_backend() == "cpu"  # the CUDA compile plugin did not take over
    f, floor = report["step"]["forecast"], report["step"]["time"]["roofline_s"]
    assert f["s_per_step"] >= floor and f["calibration"]["device"] == report["target"].split(
        "deviceless ")[1].split(" x ")[0]  # the card's calibration, not this CPU's


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
def test_buffer_assignment_sums_like_memory_analysis(tmp_path):
    """The detached gate's reading of XLA's dump, against XLA's own figures (donation on,
    so alias counts too)."""
    f = jax.jit(lambda s, x: (s + x @ x.T, jax.numpy.tanh(x).sum()), donate_argnums=0)
    compiled = f.lower(jax.numpy.zeros((256, 256)), jax.numpy.ones((256, 64))).compile(
        {"xla_dump_to": str(tmp_path)})
    ma = compiled.memory_analysis()
    sizes = xla_dump.assignment_sizes(
        next(tmp_path.glob("*after_optimizations-buffer-assignment.txt")))
    assert (sizes["argument"], sizes["output"], sizes["temp"], sizes["alias"]) == (
        ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.temp_size_in_bytes,
        ma.alias_size_in_bytes)
    assert sizes["alias"] == 256 * 256 * 4


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
@pytest.mark.slow  # two deviceless compiles for 64 B200s (about a minute)
def test_detached_deviceless_gate_reports_what_the_whole_compile_does(tmp_path):
    """A gate-only deviceless run reads its figures at XLA's buffer assignment and leaves
    code generation running; the figures equal those of the finished compile."""
    cfg = _cfg(tmp_path)
    cfg = dc.replace(cfg, data=dc.replace(cfg.data, batch_size=4096),
                     mesh=dc.replace(cfg.mesh, hosts=8, gpus_per_host=8, shard_state=True),
                     gate=dc.replace(cfg.gate, only=True, target="b200"))
    whole = decompose(cfg, tmp_path / "whole")["gate"]
    early = decompose(cfg, tmp_path / "early", Hooks(detach_gate=True))["gate"]
    detached = [t for t, _ in xla_dump._detached]
    for t in detached:  # this process goes on; a front end would end it (xla_dump.end_process)
        t.join()
    assert detached
    for k in ("argument", "output", "temp", "alias", "peak"):
        assert early[f"{k}_bytes"] == whole[f"{k}_bytes"], k
    assert whole["xla_peak_bytes"] > 0
    # the reading came from the buffer assignment, not from the finished compile (code
    # generation takes seconds even here; the reader polls every 0.1 s)
    assert early["xla_peak_bytes"] is None
    assert early["fits"] == whole["fits"]


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
def test_deviceless_target_without_gate_only_is_a_config_error(tmp_path):
    cfg = _cfg(tmp_path)
    cfg = dc.replace(cfg, gate=dc.replace(cfg.gate, target="h100"))
    with pytest.raises(ConfigError, match="gate.target='h100'.*gate.only=true"):
        decompose(cfg, tmp_path / "run")


@pytest.mark.slow  # 13-18 s: outside the quick tier (make test-fast)
def test_fit_batch_finds_the_largest_batch_under_the_cap(tmp_path):
    # cap set between the peaks of batch 256 and 4096: the search must land in between,
    # and the chosen batch must fit while the next candidate up does not.
    cfg = _cfg(tmp_path)
    small = decompose(dc.replace(cfg, gate=dc.replace(cfg.gate, only=True)), tmp_path / "a")
    big = decompose(dc.replace(cfg, data=dc.replace(cfg.data, batch_size=4096),
                               gate=dc.replace(cfg.gate, only=True)), tmp_path / "b")
    cap = (small["gate"]["peak_bytes"] + big["gate"]["peak_bytes"]) / 2
    fit_cfg = dc.replace(cfg, memory=dc.replace(cfg.memory, hbm_cap_gib=cap / 2**30),
                         gate=dc.replace(cfg.gate, only=True, fit="batch", top_temps=0))
    report = decompose(fit_cfg, tmp_path / "fit")["gate"]
    fit = report["fit"]
    chosen = fit["chosen"]
    assert 256 < chosen < 4096 and report["batch_size"] == chosen and report["fits"]
    above = [t for t in fit["tried"] if t["batch_size"] > chosen]
    assert above and not any(t["fits"] for t in above)
    assert min(t["batch_size"] for t in above) - chosen <= max(1, chosen // 16) * 2
    assert str(chosen) in fit["why"]


def test_fit_batch_refuses_a_cap_between_the_arguments_and_the_peak_in_one_compile(tmp_path):
    # a cap just above the arguments of one example, below what its step needs
    cfg = _cfg(tmp_path)
    one = decompose(dc.replace(cfg, data=dc.replace(cfg.data, batch_size=1),
                               gate=dc.replace(cfg.gate, only=True, top_temps=0)),
                    tmp_path / "one")["gate"]
    cap = (one["argument_bytes"] + one["peak_bytes"]) / 2
    fit_cfg = dc.replace(cfg, memory=dc.replace(cfg.memory, hbm_cap_gib=cap / 2**30),
                         gate=dc.replace(cfg.gate, only=True, fit="batch", top_temps=0))
    with pytest.raises(GateRefused, match="even the smallest batch, 1") as e:
        decompose(fit_cfg, tmp_path / "fit")
    assert [t["batch_size"] for t in e.value.report.fit["tried"]] == [1]
    assert e.value.report.peak_bytes == one["peak_bytes"]


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
def test_matmul_flops_count_loops_rematerialization_and_branches():
    """Every dot_general of a step, a scan's body times its length, the backward's
    recomputation of a checkpointed body included, a cond's costliest branch."""
    x, w = jax.numpy.ones((64, 128)), jax.numpy.ones((128, 32))
    one = 2 * 64 * 128 * 128  # x @ y with y [128, 128]

    def f(x, y):
        def body(c, _):
            return jax.checkpoint(lambda c: jax.numpy.tanh(c @ y))(c), None
        return jax.lax.scan(body, x, None, length=5)[0].sum()

    traced = jax.jit(jax.grad(f)).trace(x, jax.numpy.ones((128, 128)))
    # forward 5, recomputed 5, and the cotangent of c 5 (no gradient of y is asked for)
    assert gate.matmul_flops(traced.jaxpr) == 15 * one

    def g(p, x):
        return jax.lax.cond(p, lambda x: (x @ w).sum(), lambda x: x.sum(), x)

    batched = jax.jit(lambda a, b: jax.numpy.einsum("bij,bjk->bik", a, b)).trace(
        jax.numpy.ones((3, 4, 5)), jax.numpy.ones((3, 5, 6)))
    assert gate.matmul_flops(jax.jit(g).trace(True, x).jaxpr) == 2 * 64 * 128 * 32
    assert gate.matmul_flops(batched.jaxpr) == 2 * 3 * 4 * 5 * 6


@pytest.mark.jax_versions  # XLA's buffer assignment, dump and figures
@pytest.mark.slow  # 13-18 s: outside the quick tier (make test-fast)
def test_offloaded_optimizer_moments_on_a_deviceless_gpu_are_an_upper_bound(tmp_path):
    """memory.offload_opt_state: compile-only GPUs have no host memory space (jax drops the
    memory kind), so the gate counts the moments as device arguments and says so; the step
    compiles, with the same bytes as without offload."""
    def gate_of(offload, name):
        cfg = _cfg(tmp_path, offload_opt_state=offload)
        cfg = dc.replace(cfg, mesh=dc.replace(cfg.mesh, hosts=1, gpus_per_host=8),
                         gate=dc.replace(cfg.gate, only=True, target="h100"))
        return decompose(cfg, tmp_path / name)["gate"]

    plain, offloaded = gate_of(False, "plain"), gate_of(True, "offload")
    parts = offloaded["argument_parts_bytes"]
    assert parts["optimizer moments (host)"] == plain["argument_parts_bytes"][
        "optimizer moments"] > 0
    assert offloaded["argument_bytes"] == plain["argument_bytes"] == sum(parts.values())
    assert offloaded["host_argument_bytes"] == 0
    assert "upper bound" in offloaded["note"] and "note" not in plain

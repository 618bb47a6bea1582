"""The gate's forecast (pdecomp.gate.forecast): the kernels it reads from a compiled module,
the calibration it reads them at, and that no forecast is below its floor."""

from __future__ import annotations

import dataclasses as dc
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import run_on_cpu_devices
from jax import lax
from test_step_cost import STEP

from pdecomp.core import hardware
from pdecomp.core.config import ConfigError
from pdecomp.gate import calibration, dots, forecast, microbench, step_cost
from pdecomp.gate.calibration import Calibration, Curve

M, K, N = 64, 96, 32


def compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def mlp_step(w1, w2, x):
    """A small training step: forward, backward, update; a loop of 3 over layers."""

    def loss(ws):
        h = jnp.tanh(x @ ws[0])
        y, _ = lax.scan(lambda c, _: (jnp.tanh(c @ ws[1]), None), h, None, length=3)
        return jnp.mean(y ** 2)

    grads = jax.grad(loss)((w1, w2))
    return jax.tree.map(lambda w, g: w - 1e-3 * g, (w1, w2), grads)


PROGRAMS = {
    "mlp_step": (mlp_step, (jnp.ones((K, N)), jnp.ones((N, N)), jnp.ones((M, K)))),
    "bf16_matmul_chain": (lambda a, b: lax.optimization_barrier(a @ b) @ b.T,
                          (jnp.ones((M, K), jnp.bfloat16), jnp.ones((K, K), jnp.bfloat16))),
    "elementwise": (lambda x: jnp.exp(jnp.sin(x) * 2.0).sum(), (jnp.ones((4096,)),)),
}


def test_a_matmul_and_an_elementwise_kernel_are_read_as_the_forecast_counts_them() -> None:
    def fn(a, b):
        y = lax.optimization_barrier(a @ b)
        return jnp.tanh(y * 2.0 + 1.0)

    ks = step_cost.kernels(compiled_text(fn, jnp.ones((M, K)), jnp.ones((K, N))), 1)
    (mm,) = [k for k in ks if k.flops]
    assert mm.flops == 2 * M * K * N and mm.dtype == "float32" and mm.runs == 1
    (ew,) = [k for k in ks if k.transcendentals]
    assert ew.transcendentals == M * N  # one tanh an element
    assert ew.ops >= 2 * M * N  # the multiply and the add
    assert ew.bytes == 2 * M * N * 4  # read once, written once


def test_a_loops_kernels_count_its_trip_count() -> None:
    def fn(x, w):
        return lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c @ w), x)

    ks = step_cost.kernels(compiled_text(fn, jnp.ones((M, K)), jnp.ones((K, K))), 1)
    assert sum(k.runs * k.flops for k in ks) == 5 * 2 * M * K * K


def sliced_ops_per_element(expression) -> float:
    """Cheap ops an element of a [4096, 200] value `expression(x, s)` that twenty fusions
    slice, each into a [4096, 10] window, summed over the twenty."""

    def split(x, w, s):
        return [(p * p + s) @ w for p in jnp.split(expression(x, s), 20, axis=1)]

    text = compiled_text(split, jnp.ones((4096, 200)), jnp.ones((10, 8)), 1.5)
    sliced = [k for k in step_cost.kernels(text, 1) if k.ops and not k.flops]
    assert len(sliced) == 20 and len({k.ops for k in sliced}) == 1
    return sum(k.ops for k in sliced) / (4096 * 200)


def test_a_fusion_that_slices_counts_only_the_window_it_computes() -> None:
    """XLA copies a cheap expression into each of twenty fusions that slice it (as TMS
    40-10's backward splits its [4096, 200] values by component group), and each computes
    its window only: the ops counted are the expression's once over, not twenty times."""
    per_element = sliced_ops_per_element(
        lambda x, s: x * s + 1.0 - x * x * s + jnp.where(x > s, x, -x))
    assert 8 <= per_element <= 14  # eleven ops an element, each counted once


def test_a_value_read_by_several_ops_is_computed_once_on_the_window() -> None:
    """Each round of the expression reads its value twice (as threefry's rounds do, which
    TMS 40-10's backward slices): both reads ask for the same window, which is computed
    once, so a fusion that slices a twentieth counts a twentieth, not 2^rounds of it."""

    def rounds(x, s):
        for _ in range(8):
            x = x * s + x * x
        return x

    assert 22 <= sliced_ops_per_element(rounds) <= 30  # three ops a round, and the square


def test_a_curve_is_log_linear_between_its_points_and_flat_beyond_them() -> None:
    c = Curve(((1e3, 1e9), (1e5, 1e11)))
    assert c(1e4) == pytest.approx(1e10)  # halfway in log size: halfway in log rate
    assert c(10) == 1e9 and c(1e9) == 1e11 and c.peak == 1e11


@pytest.fixture(scope="module")
def local() -> Calibration:
    """This CPU's calibration, as the gate takes it (measured once a test run, cached)."""
    return microbench.local(jax.devices()[0].device_kind)


def test_the_microbenchmark_measures_every_rate_the_forecast_reads(local) -> None:
    assert local.source.startswith("measured") and local.launch_s > 0
    assert set(local.matmul) == {"float32", "bfloat16"}
    for curve in (*local.matmul.values(), local.memory, local.elementwise,
                  local.transcendental):
        sizes = [s for s, _ in curve.points]
        assert sizes == sorted(sizes) and all(r > 0 for _, r in curve.points)
    assert len(local.matmul["float32"].points) >= 6 and len(local.memory.points) >= 6
    # physics: no 2-core-class CPU multiplies faster than 10 TFLOP/s or copies faster than
    # 10 TB/s (a figure beyond those would be a timing error, not a fast machine)
    assert local.matmul["float32"].peak < 1e13 and local.memory.peak < 1e13
    # first touches: XLA:CPU's large temporaries mapped anew each run (0 where a host's
    # allocator keeps them, which the probe then measures as free)
    assert 0 <= local.fresh_bytes_rate < 1e13


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("card", [None, *sorted(hardware.GPUS)])
def test_no_forecast_is_below_its_floor(program: str, card: str | None, local) -> None:
    fn, args = PROGRAMS[program]
    text = compiled_text(fn, *args)
    cal = local if card is None else calibration.for_card(card)
    f = forecast.forecast(step_cost.kernels(text, 1), forecast.Basis(cal), fresh_bytes=1 << 30)
    assert f["s_per_step"] >= f["floor_s"] > 0
    assert f["s_per_step"] == pytest.approx(sum(f["breakdown_s"].values()))
    if card:  # nor below the roofline at the card's published rates
        roof = step_cost.roofline(step_cost.measure(text, 1), hardware.GPUS[card])
        assert f["s_per_step"] >= roof["roofline_s"]


def test_collectives_are_forecast_by_their_link(local) -> None:
    """A sharded step's collectives (tests/test_step_cost.py's hand-counted one) at the
    card's link rates: across hosts slower than within one."""
    measured = "print(json.dumps(step_cost.measure(step.lower(x, W).compile().as_text(), 8, "
    script = STEP.replace(measured + "hosts=2)))",
                          "print(json.dumps(step.lower(x, W).compile().as_text()))")
    assert script != STEP
    text = run_on_cpu_devices(script, 8)
    h100 = calibration.for_card("h100")
    one_host, two_hosts = (forecast.forecast(step_cost.kernels(text, 8, hosts),
                                             forecast.Basis(h100)) for hosts in (1, 2))
    assert one_host["breakdown_s"]["collectives"] > 0
    assert two_hosts["breakdown_s"]["collectives"] > one_host["breakdown_s"]["collectives"]
    assert two_hosts["s_per_step"] >= two_hosts["floor_s"]


def test_every_card_has_a_calibration_file_that_says_where_its_figures_come_from() -> None:
    for card, spec in hardware.GPUS.items():
        cal = calibration.for_card(card)
        assert cal.device == spec.name and cal.source
        assert cal.matmul["bfloat16"].peak <= spec.bf16_flops
        assert cal.matmul["float32"].peak <= spec.tf32_flops
        assert cal.memory.peak <= spec.memory_bandwidth
        assert set(cal.links) == {"nvlink", "network"}


def test_a_calibration_round_trips_and_a_damaged_file_is_named(tmp_path: Path, local,
                                                                monkeypatch) -> None:
    path = tmp_path / "cal.json"
    calibration.write(local, path)
    assert calibration.read(path) == local
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**local.to_json(), "memory": {"points": "fast"}}))
    monkeypatch.setenv(calibration.FILE_VAR, str(bad))
    with pytest.raises(ConfigError, match="PDECOMP_CALIBRATION"):
        microbench.local("cpu")
    monkeypatch.setenv(calibration.FILE_VAR, str(path))
    assert microbench.local("cpu") == local


def test_first_touched_memory_is_counted_only_above_the_threshold(local) -> None:
    fn, args = PROGRAMS["elementwise"]
    text = compiled_text(fn, *args)
    cal = dc.replace(local, fresh_bytes_rate=1e9, fresh_threshold_bytes=1 << 20)
    ks, basis = step_cost.kernels(text, 1), forecast.Basis(cal)
    below = forecast.forecast(ks, basis, fresh_bytes=1 << 19)
    above = forecast.forecast(ks, basis, fresh_bytes=1 << 30)
    kept = forecast.forecast(ks, dc.replace(basis, fresh_temporaries=False), 1 << 30)
    assert kept["breakdown_s"]["fresh_memory"] == 0
    assert below["breakdown_s"]["fresh_memory"] == 0
    assert above["breakdown_s"]["fresh_memory"] == pytest.approx((1 << 30) / 1e9)


def test_calibrate_writes_a_calibration_and_refuses_what_it_would_overwrite(
        tmp_path: Path, env: dict[str, str]) -> None:
    from conftest import pdecomp

    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    proc = pdecomp(["calibrate", "-o", str(mine)], tmp_path, env)
    assert proc.returncode == 2 and "not a calibration file" in proc.stderr
    assert proc.stderr.count("\n") == 1 and mine.read_text() == '{"mine": true}'
    proc = pdecomp(["calibrate", "-o", str(tmp_path)], tmp_path, env)
    assert proc.returncode == 2 and "a file to write" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json"]  # nothing written
    proc = pdecomp(["calibrate", "-o", str(tmp_path / "a.json"), "optim.stepz=3"], tmp_path,
                   env)
    assert proc.returncode == 2 and "optim.stepz" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "a.json").exists()
    proc = pdecomp(["calibrate", "gate.only=true", "gate.target=h100"], tmp_path, env)
    assert proc.returncode == 2 and "leave gate.target unset" in proc.stderr
    # with a run's overrides, every dot of its step that counts is measured into the cache
    out, cache = tmp_path / "new" / "cpu.json", tmp_path / "cache"
    proc = pdecomp(["calibrate", "-o", str(out), "data.batch_size=1024"], tmp_path,
                   {**env, calibration.DIR_VAR: str(cache)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    cal = calibration.read(out)
    assert cal.source.startswith("measured") and cal.matmul["float32"].peak > 0
    (dots_file,) = cache.glob("*-dots.json")
    measured = json.loads(dots_file.read_text())
    # the measurement is this machine's cached calibration from now on, as `-o` wrote it
    (cached,) = set(cache.glob("*.json")) - {dots_file}
    assert calibration.read(cached) == cal
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("the step's dots: "))
    counted, of, total = line.split(": ")[1].split()[:3]
    assert int(counted) == len(measured) >= 4 and of == "of"
    # the shapes left out are named only where there are some
    assert ("not measurable" in line) == (len(measured) < int(total))


def test_a_job_that_reuses_its_temporaries_is_forecast_without_first_touches(
        tmp_path: Path) -> None:
    """The TMS 5-2 step at batch 4096 holds 36 MiB of temporaries: a library caller's
    process maps them anew every step, a `pdecomp` job's keeps them (launcher/host.py)."""
    from pdecomp.core.config import RunConfig
    from pdecomp.gate.step import gate
    from pdecomp.run.decompose import prepare

    base = RunConfig()
    cfg = dc.replace(base, model=dc.replace(base.model, cache_dir=str(tmp_path / "cache")),
                     gate=dc.replace(base.gate, only=True, top_temps=0))
    run = prepare(cfg)
    for reused in (False, True):
        (tmp_path / str(reused)).mkdir()
    fresh, kept = (gate(run, tmp_path / str(reused), False, lambda _: None, reused)
                   .report.step["forecast"] for reused in (False, True))
    assert fresh["breakdown_s"]["fresh_memory"] > 0 == kept["breakdown_s"]["fresh_memory"]
    # the kernels alike, but for the dots the second gate may have measured since (each
    # gate measures them for a tenth of its compile at most): never faster for that
    assert kept["kernels"] == fresh["kernels"]
    assert kept["breakdown_s"]["launch"] == pytest.approx(fresh["breakdown_s"]["launch"])
    assert 0 <= fresh["dots_measured"] <= kept["dots_measured"] <= kept["dots"]
    kernels_s = [f["s_per_step"] - f["breakdown_s"]["fresh_memory"] for f in (fresh, kept)]
    assert kernels_s[0] <= kernels_s[1] * (1 + 1e-9)
    assert kept["dots_measured"] > fresh["dots_measured"] or kernels_s[0] == pytest.approx(
        kernels_s[1])


def test_each_transcendental_op_is_weighted_by_its_measured_cost(local) -> None:
    """A power costs several tanh (log, multiply, exp): the forecast weighs each op of a
    kernel by what the microbenchmark measured it to cost against tanh."""
    text = compiled_text(lambda x: jnp.tanh(x) + x ** (x + 0.5), jnp.ones((1 << 16,)))
    (k,) = [k for k in step_cost.kernels(text, 1) if k.transcendentals]
    assert dict(k.transcendental_ops) == {"tanh": 1 << 16, "power": 1 << 16}
    assert k.transcendentals == 2 << 16
    assert set(local.transcendental_cost) >= {"power", "exponential", "log", "logistic"}
    assert local.transcendental_cost["power"] > 1  # measured: log, multiply and exp
    unit = dc.replace(local, transcendental_cost={})
    rate = local.transcendental(k.transcendentals)
    assert forecast.transcendental_seconds(k, unit) == pytest.approx(k.transcendentals / rate)
    weighted = (1 + local.transcendental_cost["power"]) * (1 << 16) / rate
    assert forecast.transcendental_seconds(k, local) == pytest.approx(weighted)


def test_a_dots_signature_rebuilds_it_and_its_measured_time_is_what_the_forecast_reads(
        local, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(calibration.DIR_VAR, str(tmp_path))

    def fn(a, b):  # a transposed contraction, as a backward pass makes
        return lax.dot_general(a, b, (((0,), (0,)), ((), ())))

    ks = step_cost.kernels(compiled_text(fn, jnp.ones((512, 96)), jnp.ones((512, 32))), 1)
    (k,) = [k for k in ks if k.flops]
    ((sig, flops),) = k.dots
    assert sig == "f32[512,96];f32[512,32];f32[96,32];0;0;;" and flops == k.flops
    cal = dots.with_dots(local, ks)
    seconds = cal.dot_seconds[sig]
    # physics: no faster than the host's best square products, nor than reading it once
    assert flops / seconds < 2 * local.matmul["float32"].peak
    assert seconds > (512 * 128 * 4) / (10 * local.memory.peak)
    cached = json.loads(calibration.dots_cache_path(local.device).read_text())
    assert cached == {sig: seconds}
    assert dots.with_dots(local, ks, budget_s=0.0).dot_seconds == {sig: seconds}
    # a dot is never forecast faster than square products of its FLOPs, slower where
    # its shape measured slower
    curve = flops / local.matmul_rate("float32", flops)
    assert cal.dot_time(sig, "float32", flops) == max(curve, seconds)
    assert cal.dot_time("f32[1,1];f32[1,1];f32[1,1];1;0;;", "float32", flops) == curve
    f = forecast.forecast(ks, forecast.Basis(cal))
    assert f["s_per_step"] >= f["floor_s"] > 0


def test_no_dot_is_measured_without_budget_and_with_it_every_one(local, tmp_path: Path,
                                                                 monkeypatch) -> None:
    monkeypatch.setenv(calibration.DIR_VAR, str(tmp_path))
    fn, args = PROGRAMS["mlp_step"]
    ks = step_cost.kernels(compiled_text(fn, *args), 1)
    assert dots.with_dots(local, ks, budget_s=-1.0).dot_seconds == {}
    big = step_cost.Kernel("big", 1, 2 * 1024 ** 3, 0, "float32", 0, 0, 1 << 24,
                           dots=(("f32[1024,1024];f32[1024,1024];f32[1024,1024];1;0;;",
                                  2 * 1024 ** 3),))
    measured = dots.with_dots(local, [*ks, big], budget_s=60.0).dot_seconds
    # the step's own dots too, each under 0.5% of the big one's time at the curve's rate
    assert set(measured) == {sig for k in [*ks, big] for sig, _ in k.dots}
    assert len(measured) > 1


def test_a_probe_too_long_for_what_is_left_is_skipped_for_one_that_fits(
        local, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(calibration.DIR_VAR, str(tmp_path))
    # the big one is never run (its probe does not fit): large enough to be the longer on
    # any host, its chain's dots each 2 x 4096^3 FLOPs; the thin one's fits
    big_sig = "f32[4096,4096];f32[4096,4096];f32[4096,4096];1;0;;"
    thin_sig = "f32[4096,160];f32[160,10];f32[4096,10];1;0;;"
    big_flops, thin_flops = 2 * 4096 ** 3, 2 * 4096 * 160 * 10
    big = step_cost.Kernel("big", 1, big_flops, 0, "float32", 0, 0, 1 << 24,
                           dots=((big_sig, big_flops),))
    thin = step_cost.Kernel("thin", 1000, thin_flops, 0, "float32", 0, 0, 1 << 20,
                            dots=((thin_sig, thin_flops),))
    cost = {sig: dots.probe_cost_s(sig, f / local.matmul_rate("float32", f))
            for sig, f in ((big_sig, big_flops), (thin_sig, thin_flops))}
    assert cost[thin_sig] < 0.5 * cost[big_sig]
    measured = dots.with_dots(local, [big, thin], budget_s=0.9 * cost[big_sig]).dot_seconds
    assert list(measured) == [thin_sig]

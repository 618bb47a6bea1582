"""gate.fit=batch: the search for the largest batch under the cap, counted in compiles; and
gate.fit=microbatches: the fewest microbatches under the cap."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import gate_report as report_of
from conftest import load_json, ok, pdecomp

from pdecomp.gate.fit import fit_batch, fit_mesh, fit_microbatches
from pdecomp.gate.report import GateReport, rows

MiB = 2**20


class Compiler:
    """A fake `compile_at`: the peak a function of the batch, each call counted."""

    def __init__(self, peak: Callable[[int], float], cap: float):
        self.peak, self.cap, self.calls = peak, cap, []

    def __call__(self, batch: int):
        self.calls.append(batch)
        p = int(self.peak(batch))
        return f"exe{batch}", report_of(peak_bytes=p, cap_bytes=int(self.cap), fits=p <= self.cap)

    def largest(self, step: int, top: int) -> int | None:
        """The true answer, by brute force (a monotone peak)."""
        fitting = [b for b in range(step, top + 1, step) if self.peak(b) <= self.cap]
        return max(fitting) if fitting else None


def affine(state: float, per_example: float) -> Callable[[int], float]:
    return lambda b: state + per_example * b


def check_answer(compiler: Compiler, chosen: int, report: GateReport, step: int, top: int) -> None:
    """The chosen batch fits, is a multiple of step, and the true largest is within 1/16."""
    truth = compiler.largest(step, top)
    assert chosen % step == 0 and chosen <= top and report.fits
    assert chosen <= truth and truth - chosen <= max(step, chosen // 16), (chosen, truth)
    fit = report.fit
    assert fit["chosen"] == chosen and fit["mode"] == "batch"
    assert [t["batch_size"] for t in fit["tried"]] == sorted(set(compiler.calls))
    assert len(compiler.calls) == len(set(compiler.calls))  # no batch compiled twice


@pytest.mark.parametrize("cap", [0.001 * 2**30, 10 * MiB + 1])
def test_an_impossible_cap_costs_one_compile(cap):
    # the state alone is 10 MiB: both caps are below the smallest batch's peak
    compiler = Compiler(affine(10 * MiB, 4096), cap)
    chosen, exe, report = fit_batch(compiler, 4096, 8, 1 << 20)
    assert compiler.calls == [8]
    assert chosen == 8 and exe == "exe8" and not report.fits
    assert report.fit["tried"] == [{"batch_size": 8, "peak_bytes": 10 * MiB + 8 * 4096,
                                       "fits": False}]
    assert "smallest batch, 8" in report.fit["why"]


def test_a_cap_below_the_arguments_costs_no_compile():
    compiler = Compiler(affine(10 * MiB, 4096), 5 * MiB)

    def floor_at(batch):
        return report_of(peak_bytes=10 * MiB, cap_bytes=5 * MiB, fits=False, compiled=False,
                         batch_size=batch)

    chosen, exe, report = fit_batch(compiler, 4096, 8, 1 << 20, floor_at)
    assert compiler.calls == [] and exe is None
    assert chosen == 8 and not report.fits and report.fit["tried"] == []
    assert "nothing compiled" in report.fit["why"]


def test_a_floor_under_the_cap_changes_nothing():
    compiler = Compiler(affine(MiB, 1000), 100 * MiB)
    floor = report_of(peak_bytes=MiB, cap_bytes=100 * MiB, fits=True)
    assert fit_batch(compiler, 64, 1, 1 << 20, lambda b: floor)[0] == \
        fit_batch(Compiler(affine(MiB, 1000), 100 * MiB), 64, 1, 1 << 20)[0]


@pytest.mark.parametrize("start", [1, 256, 4096, 65536, 1 << 20])
@pytest.mark.parametrize("step", [1, 8])
def test_an_affine_peak_is_found_in_few_compiles(start, step):
    # 1 + 2 + 1: the smallest batch, the configured one (when larger), the line's answer,
    # the batch a tolerance above it that does not fit
    compiler = Compiler(affine(3 * MiB, 1234.5), 40 * MiB)
    chosen, exe, report = fit_batch(compiler, start, step, 1 << 20)
    check_answer(compiler, chosen, report, step, 1 << 20)
    assert exe == f"exe{chosen}"
    assert len(compiler.calls) <= 4, compiler.calls


@pytest.mark.parametrize("peak", [
    lambda b: 2 * MiB + 40 * b ** 1.5,  # superlinear: the line overshoots from below
    lambda b: 2 * MiB + 3e4 * math.sqrt(b),  # concave: the line undershoots
    lambda b: 2 * MiB + 900 * b + (4 * MiB if b > 20_000 else 0),  # a step (XLA's remat)
    lambda b: 2 * MiB + 900 * b * (1 + (b // 4096) % 2 * 0.05),  # piecewise, with jumps
], ids=["superlinear", "concave", "step", "sawtooth"])
@pytest.mark.parametrize("start", [16, 4096, 100_000])
def test_a_curved_peak_still_finds_the_largest_batch(peak, start):
    compiler = Compiler(peak, 30 * MiB)
    chosen, _, report = fit_batch(compiler, start, 16, 1 << 20)
    if compiler.largest(16, 1 << 20) is not None and all(
            peak(b) <= peak(b + 16) for b in range(16, 40_000, 16)):  # monotone: exact
        check_answer(compiler, chosen, report, 16, 1 << 20)
    assert report.fits and chosen % 16 == 0
    assert not any(t["fits"] for t in report.fit["tried"] if t["batch_size"] > chosen)
    # never worse than about twice the bisection's count
    assert len(compiler.calls) <= 2 * (math.ceil(math.log2(1 << 20)) + 4), compiler.calls


def test_the_search_stops_at_the_max_batch():
    compiler = Compiler(affine(MiB, 100), 1 << 40)  # everything fits
    chosen, _, report = fit_batch(compiler, 256, 8, 5003)
    assert chosen == 5000 and report.fits  # the largest multiple of 8 up to 5003
    assert "gate.fit_max_batch=5003" in report.fit["why"]
    assert len(compiler.calls) <= 3, compiler.calls
    # a max batch below the smallest: the smallest alone is compiled
    compiler = Compiler(affine(MiB, 100), 1 << 40)
    assert fit_batch(compiler, 256, 8, 4)[0] == 8 and compiler.calls == [8]


def test_the_smallest_batch_alone_fits():
    compiler = Compiler(affine(MiB, MiB), 2.5 * MiB)  # batch 1: 2 MiB, batch 2: 3 MiB
    chosen, _, report = fit_batch(compiler, 64, 1, 1 << 20)
    assert chosen == 1 and report.fits and len(compiler.calls) <= 3, compiler.calls
    assert "batch 2 needs" in report.fit["why"]


def test_the_report_table_says_how_many_batches_were_compiled():
    compiler = Compiler(affine(10 * MiB, 4096), MiB)
    _, _, report = fit_batch(compiler, 4096, 8, 1 << 20)
    row = dict(_fit_rows(report))
    assert row["fit"].startswith("1 batches compiled: even the smallest batch, 8")


def _fit_rows(report: GateReport) -> list[tuple[str, str]]:
    return [r for r in rows(report) if r[0] == "fit"]


def test_cli_impossible_cap_refuses_without_a_search(tmp_path: Path, env: dict[str, str]) -> None:
    """TMS with a cap below its arguments: exit 3 and one line, with nothing compiled."""
    run_dir = tmp_path / "fit"
    proc = pdecomp(["gate.fit=batch", "memory.hbm_cap_gib=0.000001", "logging.wandb.mode=disabled",
                    f"hydra.run.dir={run_dir}"], tmp_path, env)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
    # the console wraps long lines: the refusal is what follows its one "gate refused"
    assert proc.stderr.count("gate refused") == 1, proc.stderr[-3000:]
    refusal = " ".join(proc.stderr.split("gate refused")[1].split())
    assert refusal.startswith(": no batch fits (gate.fit=batch)"), refusal
    assert "nothing compiled" in refusal, refusal
    gate = load_json(run_dir / "gate.json")
    assert gate["fits"] is False and gate["compiled"] is False
    assert gate["fit"]["tried"] == [] and gate["batch_size"] == 1
    assert "0 batches compiled" in proc.stderr


# gate.fit=microbatches: the peak falls as the count grows (fewer examples' activations each)
def per_microbatch(state: float, per_example: float, batch: int) -> Callable[[int], float]:
    return lambda m: state + per_example * batch / m


@pytest.mark.parametrize("cap_mib", [10.5, 11, 12.5, 20, 26, 40, 1000])
def test_the_fewest_microbatches_that_fit_are_found_by_bisection(cap_mib):
    counts = [1, 2, 4, 8, 16, 32, 64]  # a batch of 64 per data-axis device
    compiler = Compiler(per_microbatch(10 * MiB, MiB / 4, 64), cap_mib * MiB)
    chosen, exe, report = fit_microbatches(compiler, counts)
    truth = min(m for m in counts if compiler.peak(m) <= compiler.cap)
    assert chosen == truth and exe == f"exe{truth}" and report.fits
    fit = report.fit
    assert fit["mode"] == "microbatches" and fit["chosen"] == truth
    assert [t["microbatches"] for t in fit["tried"]] == sorted(set(compiler.calls))
    assert len(compiler.calls) == len(set(compiler.calls))  # no count compiled twice
    # the most, the fewest, then bisection: at most 2 + log2(7) compiles
    assert compiler.calls[:2] == [64, 1] and len(compiler.calls) <= 5, compiler.calls
    assert f"{truth} microbatches peak at" in fit["why"]


def test_no_microbatch_count_fits_costs_one_compile():
    compiler = Compiler(per_microbatch(10 * MiB, MiB, 64), 5 * MiB)
    chosen, _, report = fit_microbatches(compiler, [1, 2, 4, 8, 16, 32, 64])
    assert chosen == 64 and not report.fits and compiler.calls == [64]
    assert report.fit["why"].startswith("even 64 microbatches")


@pytest.mark.slow  # four compiles of batch 256 (most of three minutes); fit_microbatches'
# choice is the fast tier's above, and the CLI's gate.fit path is test_cli_fit_mesh's
def test_cli_fit_microbatches_takes_the_fewest_under_the_cap(tmp_path: Path,
                                                             env: dict[str, str]) -> None:
    """The residual MLP at batch 256 (its activations most of its peak) under a cap of 3/4
    of its 1-microbatch peak: the run takes the fewest microbatches whose compiled
    peak is under the cap, and gate.json says which counts were compiled and their peaks."""
    run_dir = tmp_path / "fit"
    base = ["+experiment=resid_mlp1", "data.batch_size=256", "gate.only=true",
            "logging.wandb.mode=disabled"]
    ok(pdecomp([*base, "optim.microbatches=1", f"hydra.run.dir={tmp_path / '1'}"], tmp_path,
               env))
    peak_1 = load_json(tmp_path / "1" / "gate.json")["peak_bytes"]
    cap_gib = 0.75 * peak_1 / 2**30
    proc = pdecomp([*base, "gate.fit=microbatches", f"memory.hbm_cap_gib={cap_gib}",
                    f"hydra.run.dir={run_dir}"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gate = load_json(run_dir / "gate.json")
    fit = gate["fit"]
    assert gate["fits"] and fit["mode"] == "microbatches" and fit["chosen"] > 1
    assert gate["peak_bytes"] <= gate["cap_bytes"]
    tried = {t["microbatches"]: t for t in fit["tried"]}
    assert tried[1]["peak_bytes"] == peak_1 and not tried[1]["fits"]  # the same compile
    assert tried[fit["chosen"]]["fits"]
    assert all(not t["fits"] for m, t in tried.items() if m < fit["chosen"])
    assert f"gate.fit=microbatches: optim.microbatches={fit['chosen']}" in proc.stderr


def mesh_report(model: int, peak_mib: float, seconds: float, cap_mib: float = 100
                ) -> GateReport:
    return report_of(peak_bytes=int(peak_mib * MiB), cap_bytes=int(cap_mib * MiB),
                     fits=peak_mib <= cap_mib, mesh={"data": 8 // model, "model": model},
                     step={"time": {"roofline_s": seconds, "bound": "network"}})


@pytest.mark.parametrize(("peaks", "chosen"), [
    ({1: 90, 2: 60, 4: 50, 8: 70}, 2),  # the fastest fits
    ({1: 90, 2: 160, 4: 50, 8: 70}, 4),  # the fastest does not: the next fastest that fits
    ({1: 190, 2: 160, 4: 150, 8: 170}, 4),  # none fits: the least peak, refused
])
def test_the_mesh_that_fits_in_the_least_predicted_time_is_chosen(peaks, chosen):
    seconds = {1: 3.0, 2: 1.0, 4: 2.0, 8: 2.5}
    calls = []

    def compile_at(m):
        calls.append(m)
        return f"exe{m}", mesh_report(m, peaks[m], seconds[m])

    got, exe, report = fit_mesh(compile_at, [8, 4, 2, 1])
    assert (got, exe) == (chosen, f"exe{chosen}") and sorted(calls) == [1, 2, 4, 8]
    fit = report.fit
    assert fit["mode"] == "mesh" and fit["chosen"] == chosen
    assert report.fits == (peaks[chosen] <= 100)
    assert [(t["model"], t["step_s"], t["fits"]) for t in fit["tried"]] == [
        (m, seconds[m], peaks[m] <= 100) for m in (1, 2, 4, 8)]
    assert ("none of 4 splits fits" in fit["why"]) != report.fits


@pytest.mark.slow  # three deviceless compiles of 8 H100s (about a minute); the choice itself is
# test_the_mesh_that_fits_in_the_least_predicted_time_is_chosen's, in the quick tier
def test_cli_fit_mesh_takes_the_fastest_split_that_fits(tmp_path: Path,
                                                        env: dict[str, str]) -> None:
    """TMS gated deviceless for 2 hosts x 4 H100s: every split of the 8 whose model axis
    stays in a host is compiled; the run takes the one with the least forecast time (its
    own, model 4, the slowest)."""
    run_dir = tmp_path / "mesh"
    proc = ok(pdecomp(["gate.only=true", "gate.target=h100", "mesh.hosts=2",
                       "mesh.gpus_per_host=4", "mesh.model=4", "gate.fit=mesh",
                       "logging.wandb.mode=disabled",
                       f"hydra.run.dir={run_dir}"], tmp_path, env))
    gate = load_json(run_dir / "gate.json")
    tried = gate["fit"]["tried"]
    assert [t["mesh"] for t in tried] == [{"data": 8, "model": 1}, {"data": 4, "model": 2},
                                         {"data": 2, "model": 4}]
    fastest = min((t for t in tried if t["fits"]), key=lambda t: t["step_s"])
    assert gate["fits"] and gate["mesh"] == fastest["mesh"]
    assert gate["step"]["forecast"]["s_per_step"] == fastest["step_s"]
    assert all(t["floor_s"] <= t["step_s"] for t in tried)  # ranked by forecast, not floor
    assert fastest["model"] != 4
    resolved = load_json(run_dir / "run.json")["config"]["mesh"]
    assert (resolved["model"], resolved["data"]) == (fastest["model"], 0)
    assert f"gate.fit=mesh: mesh.model={fastest['model']}" in proc.stderr

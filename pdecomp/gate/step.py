"""A run's memory gate: the mesh, the abstract target and state in their shardings, the very
step training runs compiled ahead of time, its memory read and compared with the cap
(gate.json; GateRefused when it does not fit). gate.fit=batch first searches the largest
batch that fits, gate.fit=microbatches the fewest microbatches, gate.fit=mesh the data x
model split with the least predicted step time; each search returns the `Run` it chose."""

from __future__ import annotations

import dataclasses as dc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from pdecomp.core import hardware, sharding
from pdecomp.core.memory import SITE_LAYER_SAVES
from pdecomp.core.units import fmt_bytes
from pdecomp.gate import compiled as gate_lib
from pdecomp.gate import fit, forecast, microbench
from pdecomp.gate.report import GateReport
from pdecomp.gate.shapes import OPT_PART_HOST, abstract_run, argument_parts
from pdecomp.plan.resolve import Run
from pdecomp.spd import metrics
from pdecomp.spd.components import with_tied
from pdecomp.spd.step import TrainState, make_train_step


class GateRefused(RuntimeError):
    def __init__(self, report: GateReport):
        self.report = report
        super().__init__(f"gate refused: {refusal(report)}")


def refusal(report: GateReport) -> str:
    """Why the gate refused, with what would fit where the report knows it."""
    r = report
    what = {"batch": "no batch", "microbatches": "no microbatch count", "mesh": "no mesh"}
    if r.fit is not None:
        return f"{what[r.fit['mode']]} fits (gate.fit={r.fit['mode']}): {r.fit['why']}"
    if over := [n for n, p in (r.programs or {}).items()
                if not p["fits"] and n != "step" and r.peak_bytes <= r.cap_bytes]:
        p = r.programs[over[0]]
        return (f"the evaluation's {over[0]} program: predicted peak "
                f"{fmt_bytes(p['peak_bytes'])} > cap {fmt_bytes(r.cap_bytes)} per "
                "device beside the training state (more optim.microbatches make each "
                "held-out batch smaller)")
    why = f"predicted peak {fmt_bytes(r.peak_bytes)} > cap {fmt_bytes(r.cap_bytes)} per device"
    most = r.max_microbatches or 0
    if (r.microbatches if r.microbatches is not None else most) < most:
        why += (f"; up to {most} microbatches would hold fewer activations "
                "(gate.fit=microbatches finds the fewest that fit)")
    saves = list(SITE_LAYER_SAVES)  # most kept first
    kept = r.site_layer_saves
    if lighter := " or ".join(saves[saves.index(kept) + 1:]) if kept in saves else "":
        why += (f"; memory.site_layer_saves={lighter} would keep fewer of the site layers' "
                "activations, at more FLOPs")
    return why


@dataclass
class Gated:
    """What the gate leaves for training: the run it compiled (its batch the one
    gate.fit=batch chose), the mesh and shardings, the abstract target and state, the
    compiled step and its report."""

    run: Run
    mesh: Mesh
    batch_sharding: NamedSharding
    target_abs: Any
    state_abs: TrainState
    compiled: Any
    report: GateReport
    init_key: Array
    data_key: Array


@dataclass(frozen=True)
class Compiler:
    """Compiles the run's step at a batch or microbatch count, with the report's framing."""

    layout: sharding.Layout
    target_abs: Any
    state_abs: TrainState
    where: dict[str, Any]  # the cap, its source, the target and mesh
    memory_env: dict[str, Any] | None  # the usable-memory record, on a GPU
    detach: bool

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.layout.mesh, P(sharding.AXIS))

    def batch(self, run: Run) -> jax.ShapeDtypeStruct:
        return run.kind.batch_abstract(run.config.model, run.config.data, run.batch.size,
                                       self.batch_sharding)

    def floor(self, run: Run) -> GateReport:
        """The report from argument bytes alone (a batch too large to compile)."""
        parts = argument_parts(run, self.target_abs, self.state_abs, self.batch(run))
        # moments offloaded to the host are not device bytes on a GPU: left out of the bound
        device_bytes = sum(v for k, v in parts.items() if k != OPT_PART_HOST)
        framing = {k: self.where[k] for k in ("cap_bytes", "cap_source", "target", "mesh")}
        report = gate_lib.uncompiled_report(argument_bytes=device_bytes, parts=parts,
                                            **framing)
        return dc.replace(report, batch_size=run.batch.size, memory_env=self.memory_env)

    def basis(self, run: Run) -> forecast.Basis | None:
        """What the step at this run's batch is forecast with (None: no calibration)."""
        basis = self.where["basis"]
        tokens = run.batch.size * run.kind.tokens_per_example(run.config.data)
        return basis and dc.replace(basis, tokens_per_step=tokens)

    def compile(self, run: Run) -> tuple[Any, GateReport]:
        batch = self.batch(run)
        compiled, report = gate_lib.compile_and_report(
            make_train_step(run.step, self.layout), (self.state_abs, self.target_abs, batch),
            donate_argnums=(0,) if run.config.memory.donate else (),
            out_shardings=(sharding.shardings(self.state_abs),
                           NamedSharding(self.layout.mesh, P())),
            parts=argument_parts(run, self.target_abs, self.state_abs, batch),
            top_temps=run.config.gate.top_temps, detach=self.detach,
            **{**self.where, "basis": self.basis(run)})
        report.batch_size, report.memory_env = run.batch.size, self.memory_env
        if run.config.memory.offload_opt_state and run.placement.deviceless:
            # Compile-only devices have no host memory space: jax drops the memory kind.
            report.note = ("memory.offload_opt_state: a deviceless compile has no host "
                              "memory, so the optimizer moments count as device arguments "
                              "here (an upper bound; on the GPUs they are host arguments)")
        return compiled, report


def gate(run: Run, run_dir: Path, detach: bool, log: Callable[[str], None],
         temporaries_reused: bool = False) -> Gated:
    """Compile the run's step (after gate.fit's search), write gate.json, refuse over the
    cap. `detach`: a deviceless gate-only run may report from XLA's buffer assignment and
    leave code generation running (the front end ends the process). `temporaries_reused`:
    the process keeps a CPU step's temporaries between steps (the forecast counts no
    first-touched memory)."""
    init_key, data_key = jax.random.split(jax.random.PRNGKey(run.config.seed))
    if run.config.gate.fit == "mesh":
        run, compiler, compiled, report = search_mesh(run, init_key, log, temporaries_reused)
    else:
        # Host-memory (offload) buffers are not told apart in XLA's dump: offload compiles
        # whole.
        detach = (detach and run.config.gate.only and run.config.gate.fit == "none"
                  and run.placement.deviceless and run.config.memory.remat != "offload")
        compiler = prepare(run, init_key, detach, temporaries_reused)
        run, compiled, report = search(run, compiler, log)
    mesh = compiler.layout.mesh
    # the most microbatches: one example per data-axis device in each, and what the
    # rematerialized site layers keep (a refusal's hints)
    report.microbatches = run.batch.microbatches
    report.max_microbatches = run.batch.size // mesh.shape[sharding.AXIS]
    report.site_layer_saves = (run.config.memory.site_layer_saves if run.config.memory.remat_layers
                               else None)
    if run.config.logging.eval_every or run.config.logging.slow_eval_every:
        gate_evaluation(run, compiler, report)
    report.write(run_dir)
    return Gated(run, mesh, compiler.batch_sharding, compiler.target_abs, compiler.state_abs,
                 compiled, report, init_key, data_key)


def gate_evaluation(run: Run, compiler: Compiler, report: GateReport) -> None:
    """The in-loop evaluation's programs (the final evaluation's too) compiled on the
    state's shapes at the microbatch they run at. Each one's peak: its own, less the target,
    components and CI function it shares with the state, plus what stays resident between
    steps (the step's arguments but its batch). In the report's `programs` beside the
    step's; one over the cap refuses the run."""
    s, mesh = compiler.state_abs, compiler.layout.mesh
    x = run.kind.batch_abstract(run.config.model, run.config.data, run.batch.microbatch,
                                compiler.batch_sharding)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))
    parts = report.argument_parts_bytes
    resident = sum(v for k, v in parts.items() if k not in ("batch", OPT_PART_HOST))
    shared = gate_lib.tree_bytes((compiler.target_abs, s.components, s.ci_fn))
    programs = {"step": {"peak_bytes": report.peak_bytes, "fits": report.fits}}
    for name, fn in evaluation_programs(run, s.components, NamedSharding(mesh, P())).items():
        _, r = gate_lib.compile_and_report(
            fn, (compiler.target_abs, s.components, s.ci_fn, x, key),
            **{k: compiler.where[k] for k in ("cap_bytes", "cap_source", "target", "mesh")})
        peak = resident + r.peak_bytes - shared
        programs[name] = {"peak_bytes": peak, "program_peak_bytes": r.peak_bytes,
                          "temp_bytes": r.temp_bytes, "compile_s": r.compile_s,
                          "fits": peak <= report.cap_bytes}
    report.programs = programs
    report.fits = all(p["fits"] for p in programs.values())


def evaluation_programs(run: Run, components_abs: Any, replicated: NamedSharding
                        ) -> dict[str, Callable]:
    """The device programs the evaluation (pdecomp.run.evaluation) runs on each held-out batch, by name, each taking
    (target, components, ci_fn, batch, key) with the training state's components (tied
    sites unfolded inside, as `evaluate` does before): what the gate compiles beside the step."""
    tied = dict(run.tied)
    ci = metrics.ci_summary_program(run.config.loss.ci_threshold, replicated)
    out = {"eval/ci_summary": lambda t, c, f, x, k: ci(t, with_tied(c, tied), f, x)}
    sites = tuple(jax.eval_shape(lambda c: with_tied(c, tied), components_abs).layout.order)
    if (own := run.kind.eval_program(run.evaluation, sites)) is not None:
        out["eval/masked_forwards"] = lambda t, c, f, x, k: own(t, with_tied(c, tied), f, x, k)
    return out


def prepare(run: Run, init_key: Array, detach: bool, temporaries_reused: bool = False
            ) -> Compiler:
    """The run's mesh, its abstract target and state placed on it, the cap: what compiles
    the run's step."""
    mesh = sharding.make_mesh(run.placement)
    layout = sharding.make_layout(run.placement.mesh, mesh)
    target_abs, state_abs = abstract_run(run, init_key)
    target_abs = sharding.place(target_abs, layout)
    state_abs = sharding.place(state_abs, layout, sharding.OFFLOADED
                               if run.config.memory.offload_opt_state else ())
    cap, cap_source, memory_env = gate_cap(run, mesh)
    where = {"cap_bytes": cap, "cap_source": cap_source, "target": target_name(run, mesh),
             "mesh": dict(mesh.shape), "hosts": len({d.process_index for d in mesh.devices.flat}),
             "gpu": hardware.spec_of(run.placement.target, mesh.devices.flat[0].device_kind),
             "basis": forecast_basis(run, mesh, temporaries_reused)}
    return Compiler(layout, target_abs, state_abs, where,
                    memory_env, detach)


def forecast_basis(run: Run, mesh: Mesh, temporaries_reused: bool) -> forecast.Basis | None:
    """The calibration of the devices the run is gated for (a deviceless card's file, else
    the local device's, measured and cached), and whether its temporaries are kept."""
    card = run.placement.target if run.placement.deviceless else None
    cal = microbench.for_target(card, mesh.devices.flat[0].device_kind)
    return cal and forecast.Basis(cal, fresh_temporaries=not temporaries_reused,
                                  local=card is None)


def search_mesh(run: Run, init_key: Array, log: Callable[[str], None],
                temporaries_reused: bool = False) -> tuple[Run, Compiler, Any, GateReport]:
    """gate.fit=mesh: every split of the planned GPUs into data x model (the model axis
    within a host) compiled, the one that fits in the least predicted step time chosen."""

    def compile_at(model: int) -> tuple[Any, GateReport]:
        candidate = run.with_mesh(model)
        compiler = prepare(candidate, init_key, False, temporaries_reused)
        compiled, report = compiler.compile(candidate)
        return (candidate, compiler, compiled), report

    model, (run, compiler, compiled), report = fit.fit_mesh(
        compile_at, sharding.mesh_candidates(run.placement.mesh, run.batch.microbatch))
    if report.fits:
        log(f"gate.fit=mesh: mesh.model={model} (data {report.mesh[sharding.AXIS]}): "
            f"{report.fit['why']}")
    return run, compiler, compiled, report


def search(run: Run, compiler: Compiler, log: Callable[[str], None]
           ) -> tuple[Run, Any, GateReport]:
    """gate.fit's search, or the run's own step: the run compiled, its executable, its report."""
    if run.config.gate.fit == "batch":
        size, compiled, report = fit.fit_batch(
            lambda b: compiler.compile(run.with_batch(b)), run.batch.size,
            compiler.layout.mesh.size * run.batch.microbatches, run.config.gate.fit_max_batch,
            lambda b: compiler.floor(run.with_batch(b)))
        run = run.with_batch(size)
        if report.fits:  # a refusal says why in its own line
            log(f"gate.fit=batch: data.batch_size={size}: {report.fit['why']}")
        return run, compiled, report
    if run.config.gate.fit == "microbatches":
        m, compiled, report = fit.fit_microbatches(
            lambda m: compiler.compile(run.with_microbatches(m)),
            sharding.microbatch_counts(run.batch.size, compiler.layout.mesh.shape[sharding.AXIS]))
        run = run.with_microbatches(m)
        if report.fits:
            log(f"gate.fit=microbatches: optim.microbatches={m}: {report.fit['why']}")
        return run, compiled, report
    return run, *compiler.compile(run)


def gate_cap(run: Run, mesh: Mesh) -> tuple[int, str, dict[str, Any] | None]:
    """The per-device cap and where it came from (`gate.device_cap_bytes`; for a deviceless
    target, the card's memory from the hardware table x the usable fraction, the pool a job
    on it will have), and for a GPU the usable-memory record for gate.json (None elsewhere:
    the allocator settings are a GPU's)."""
    mem, target = run.config.memory, run.placement.target
    usable = hardware.usable_memory(mem.safety_fraction)
    deviceless = run.placement.deviceless
    gpu = deviceless or mesh.devices.flat[0].platform == "gpu"
    if mem.hbm_cap_gib <= 0 and deviceless:
        cap, source = gate_lib.target_cap_bytes(target, usable)
    else:
        cap, source = gate_lib.device_cap_bytes(mesh.local_devices[0], mem.hbm_cap_gib,
                                                mem.safety_fraction, usable)
    if not gpu:
        return cap, source, None
    if mem.hbm_cap_gib > 0 and deviceless:
        pool = int(hardware.GPUS[target].memory_bytes * usable.fraction)
        if cap > pool:  # the gate's yes would not be the job's
            source += f" (above the {fmt_bytes(pool)} the job's allocator may use)"
    return cap, f"{source}; {usable.describe()}", usable.record()


def target_name(run: Run, mesh: Mesh) -> str:
    device = mesh.devices.flat[0]
    hosts = len({d.process_index for d in mesh.devices.flat})
    where = "deviceless" if run.placement.deviceless else "local"
    return f"{where} {device.device_kind} x {mesh.size} ({hosts} host{'s' * (hosts > 1)})"


def measured_memory(mesh: Mesh) -> tuple[int, int] | None:
    """(peak, in use) bytes, the largest over this host's devices, where the backend reports
    them (GPUs do; XLA:CPU does not)."""
    stats = [d.memory_stats() or {} for d in mesh.devices.flat
             if d.process_index == jax.process_index()]
    stats = [s for s in stats if "peak_bytes_in_use" in s]
    if not stats:
        return None
    return (max(s["peak_bytes_in_use"] for s in stats), max(s["bytes_in_use"] for s in stats))


def calibrate(report: GateReport, mesh: Mesh) -> bool:
    """Put the measured peak beside the prediction; False where none is reported."""
    measured = measured_memory(mesh)
    if measured is None:
        return False
    report.measured_peak_bytes = int(measured[0])
    report.predicted_over_measured = report.peak_bytes / measured[0]
    return True


def note_peak(g: Gated, phase: str) -> None:
    """The measured peak so far (it only grows) at the end of `phase`, in the gate's report:
    which phase set the run's peak, against the step the gate predicted."""
    if (measured := measured_memory(g.mesh)) is not None:
        g.report.measured_peak_by_phase_bytes[phase] = int(measured[0])

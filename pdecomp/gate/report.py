"""The gate's report: what a compiled program needs of each device, as one typed object.

Its fields are gate.json's keys (docs/memory_gate.md); an optional part not made (no fit
search, no in-loop evaluation, no measured peak) is None and left out of the file. The
gate fills it where it learns each part; `write` puts it on disk, the one place gate.json
is written. `rows` is the gate's table.
"""

from __future__ import annotations

import dataclasses as dc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdecomp.core.units import fmt_bytes
from pdecomp.plan.files import write_json

FILE = "gate.json"


@dataclass
class GateReport:
    target: str  # where it was compiled for: "local cpu x 1 (1 host)", "deviceless ..."
    mesh: dict[str, int]
    n_devices: int
    # XLA's memory analysis, per device; peak = temp + argument + output - alias
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    host_temp_bytes: int
    host_argument_bytes: int
    peak_bytes: int
    xla_peak_bytes: int | None  # None: read at buffer assignment (a detached compile)
    cap_bytes: int
    cap_source: str
    headroom_bytes: int
    fits: bool
    compile_s: float
    flops: float | None  # XLA's cost analysis, whole mesh (None: not asked)
    matmul_flops: int | None  # the jaxpr's matmuls, whole mesh
    jax: str
    jaxlib: str
    xla_flags: str
    argument_parts_bytes: dict[str, int]  # the arguments by part (state, target, batch)
    largest_temps: list[dict[str, Any]]
    step: dict[str, Any] | None  # step_cost's per-device cost and roofline
    compiled: bool = True  # False: the arguments alone, a lower bound (never compiled)
    note: str | None = None
    batch_size: int | None = None
    memory_env: dict[str, Any] | None = None  # a GPU's usable-memory record
    microbatches: int | None = None
    max_microbatches: int | None = None
    site_layer_saves: str | None = None
    programs: dict[str, dict[str, Any]] | None = None  # the evaluation's, beside the step's
    fit: dict[str, Any] | None = None  # gate.fit's search: mode, chosen, why, tried
    measured_peak_bytes: int | None = None
    predicted_over_measured: float | None = None
    measured_peak_by_phase_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def fresh_bytes(self) -> int:
        """What a run of the step allocates anew: its temporaries and the outputs not
        aliased to its inputs (first touched each run on a CPU, pdecomp.gate.forecast)."""
        return self.temp_bytes + self.output_bytes - self.alias_bytes

    def to_json(self) -> dict[str, Any]:
        """gate.json's object: every required field, the optional parts that were made,
        `compiled` only when False."""
        out = {}
        for f in dc.fields(self):
            v = getattr(self, f.name)
            required = f.default is dc.MISSING and f.default_factory is dc.MISSING
            made = v is False if f.name == "compiled" else v is not None and v != {}
            if required or made:
                out[f.name] = v
        return out

    def write(self, run_dir: Path) -> None:
        write_json(Path(run_dir) / FILE, self.to_json())


def rows(report: GateReport) -> list[tuple[str, str]]:
    """Rows (label, value) for a table; values in MiB/GiB as fits the size."""
    r = report
    out = [("target", str(r.target)), ("mesh", " x ".join(f"{k}={v}" for k, v in r.mesh.items()))]
    if r.batch_size is not None:
        out.append(("batch", str(r.batch_size)))
    out += memory_rows(r)
    for name, p in (r.programs or {}).items():
        if name != "step":
            over = "" if p["fits"] else ", over the cap"
            out.append((f"peak in {name}", f"{fmt_bytes(p['peak_bytes'])} (state resident{over})"))
    out += [("cap", f"{fmt_bytes(r.cap_bytes)} ({r.cap_source})"),
            *([("allocator", r.memory_env["note"])] if (r.memory_env or {}).get("note") else []),
            ("headroom", fmt_bytes(r.headroom_bytes)), ("fits", "yes" if r.fits else "NO"),
            ("compile", f"{r.compile_s:.2f} s")]
    if r.jaxlib:
        out.append(("compiled by", f"jax {r.jax}, jaxlib {r.jaxlib}"))
    if r.xla_flags:
        out.append(("XLA_FLAGS", r.xla_flags))
    if r.note:
        out.append(("note", r.note))
    if r.matmul_flops:
        out.append(("matmul FLOPs / step", f"{r.matmul_flops:.3e} (whole mesh)"))
    if r.flops:
        out.append(("XLA FLOPs", f"{r.flops:.3e} (loop bodies once)"))
    out += step_rows(r.step, r.batch_size)
    if r.fit is not None:
        what = {"batch": "batches", "microbatches": "microbatch counts",
                "mesh": "meshes"}[r.fit["mode"]]
        out.append(("fit", f"{len(r.fit['tried'])} {what} compiled: {r.fit['why']}"))
    if r.measured_peak_bytes is not None:
        out.append(("measured peak", fmt_bytes(r.measured_peak_bytes)))
        out.append(("predicted / measured", f"{r.predicted_over_measured:.3f}"))
    return out


def memory_rows(r: GateReport) -> list[tuple[str, str]]:
    """XLA's sizes and the peak, then the arguments by part."""
    out = []
    for k in ("argument", "output", "temp", "alias", "host_temp", "host_argument", "peak",
              "xla_peak"):
        v = getattr(r, f"{k}_bytes")
        if not r.compiled and k not in ("argument", "peak"):
            value = "n/a (not compiled)"
        elif v is None:
            value = "n/a (read at buffer assignment)"
        else:
            value = fmt_bytes(v) if r.compiled or k != "peak" else f"at least {fmt_bytes(v)}"
        out.append((k + (" (temp+arg+out-alias)" if k == "peak" else ""), value))
    return out + [(f"  argument: {k}", fmt_bytes(v)) for k, v in r.argument_parts_bytes.items()]


def step_rows(step: dict[str, Any] | None, batch_size: int | None = None
              ) -> list[tuple[str, str]]:
    """The step's cost per device, its forecast and its floor where the rates are known."""
    if not step:
        return []
    out = [("step per device", (f"{step['flops']:.3e} FLOPs, {fmt_bytes(step['hbm_bytes'])} "
                               "HBM read+written"))]
    for kind, c in step["collectives"].items():
        out.append((f"  {kind}", (f"{c['count']} x, {fmt_bytes(c['bytes'])} sent"
                                 f" ({fmt_bytes(c['network_bytes'])} across hosts)")))
    if f := step.get("forecast"):
        out += forecast_rows(f, batch_size)
    if t := step.get("time"):
        out.append(("predicted step (a floor)", (
            f"{t['roofline_s']:.3g} s, {t['bound']}-bound (compute {t['compute_s']:.3g} s, "
            f"HBM {t['hbm_s']:.3g} s, network {t['network_s']:.3g} s; "
            f"no overlap {t['serial_s']:.3g} s)")))
    return out


def forecast_rows(f: dict[str, Any], batch_size: int | None) -> list[tuple[str, str]]:
    """The forecast: seconds a step and what it buys, where they go, what it read."""
    s = f["s_per_step"]
    rate = (f"{f['tokens_per_s']:,.0f} tokens/s" if f.get("tokens_per_s") else
            f"{batch_size / s:,.0f} examples/s" if batch_size and s else "")
    b = f["breakdown_s"]
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.3g} s" for k, v in b.items() if v)
    measured = (f"; {f['dots_measured']} of its {f['dots']} dot shapes measured on it "
                "(`pdecomp calibrate` with the run's overrides measures all that count)"
                if "dots" in f else "")
    return [("forecast step", f"{s:.3g} s ({rate}); floor {f['floor_s']:.3g} s"),
            ("  where it goes", f"{parts}; {f['kernels']} kernels, collectives serial"),
            ("  calibration",
             f"{f['calibration']['device']}: {f['calibration']['source']}{measured}")]

"""The memory gate of an analysis: its step (`harvest.step_fn`: CI of a batch, reduced
per component) compiled on abstract inputs, on the mesh it will run on, before anything is
read; its per-device peak against the cap, as training's gate reports it.

On a mesh of n devices the components and the CI function are split along C (`comp`
onto the model axis), and so are the step's [positions, C] temporaries: a run whose
components do not fit one device is read on several.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdecomp.analysis import harvest
from pdecomp.core import hardware
from pdecomp.core.sharding import AXIS, MODEL
from pdecomp.core.units import fmt_bytes
from pdecomp.gate import compiled as gate_lib
from pdecomp.gate.report import GateReport
from pdecomp.plan.resolve import Run
from pdecomp.run.load import placed_abstract
from pdecomp.spd.components import with_tied


def analysis_cap(run: Run, mesh: Mesh, cap_gib: float | None, target: str | None
                 ) -> tuple[int, str]:
    """The per-device cap: `cap_gib`, else the run's `memory.hbm_cap_gib`, else (deviceless,
    `target` a GPU kind) the card's memory x the usable fraction a job on it has, else what
    the devices analysed on hold (gate.device_cap_bytes)."""
    mem = run.config.memory
    gib = mem.hbm_cap_gib if cap_gib is None else cap_gib
    usable = hardware.usable_memory(mem.safety_fraction)
    if target and gib <= 0:
        return gate_lib.target_cap_bytes(target, usable)
    if target:
        return int(gib * 2**30), ("--hbm-cap-gib" if cap_gib is not None
                                  else "memory.hbm_cap_gib")
    cap, source = gate_lib.device_cap_bytes(mesh.devices.flat[0], gib, mem.safety_fraction,
                                            usable)
    return cap, ("--hbm-cap-gib" if cap_gib is not None else source)


def target_mesh(target: str, devices: int, gpus_per_host: int) -> Mesh:
    """`devices` compile-only GPUs of kind `target`, `gpus_per_host` to a host, as the
    analysis mesh (the model axis spanning them all)."""
    per_host = min(gpus_per_host, devices)
    return hardware.topology_mesh(target, devices // per_host, per_host,
                                  ((AXIS, 1), (MODEL, devices)))


def cofire_rows(mesh: Mesh, n: int) -> NamedSharding:
    """A group's [n, n] co-firing counts split along their rows over the model axis, as the
    components along C; whole on each device where the axis does not divide n."""
    return NamedSharding(mesh, P(MODEL, None) if n % mesh.shape[MODEL] == 0 else P())


def gate(run: Run, mesh: Mesh, o: harvest.Options, batch_size: int,
         cap_gib: float | None, target: str | None = None) -> GateReport:
    """The analysis step's gate report on `mesh` (fits: its peak is under the cap);
    `target`: the GPU kind of a deviceless mesh."""
    target_abs, state_abs = placed_abstract(run, mesh)
    batch = run.kind.batch_abstract(run.config.model, run.config.data, batch_size,
                                    NamedSharding(mesh, P()))
    tied, step = dict(run.tied), harvest.step_fn(o)
    C = state_abs.components.site_C
    C |= {s: C[source] for s, source in tied.items()}  # a tied site shares its source's C
    cofire = tuple(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=cofire_rows(mesh, shape[0]))
                   for shape in harvest.cofire_shapes(o, C))
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))

    def analysis_step(target: Any, components: Any, ci_fn: Any, x: Any, k: Any, co: Any
                      ) -> Any:
        return step(target, with_tied(components, tied), ci_fn, x, k, co)

    cap, source = analysis_cap(run, mesh, cap_gib, target)
    where = f"{target} (deviceless)" if target else mesh.devices.flat[0].platform
    _, report = gate_lib.compile_and_report(
        analysis_step, (target_abs, state_abs.components, state_abs.ci_fn, batch, key, cofire),
        donate_argnums=(5,), cap_bytes=cap, cap_source=source,  # as analyze's step donates
        target=f"analysis on {mesh.size} {where} device(s)", mesh=dict(mesh.shape),
        hosts=len({d.process_index for d in mesh.devices.flat}),
        gpu=hardware.spec_of(target or "local", mesh.devices.flat[0].device_kind))
    report.batch_size = batch_size
    return report


def refusal(report: GateReport) -> str:
    """The one line a refused analysis ends with."""
    return (f"analysis refused: predicted peak {fmt_bytes(report.peak_bytes)} > cap "
            f"{fmt_bytes(report.cap_bytes)} per device ({report.cap_source}) on "
            f"{report.n_devices} device(s); more devices (--devices) split the components "
            "along C; a smaller --batch-size, --no-ablation or --no-cofire shrink the step's "
            "temporaries")

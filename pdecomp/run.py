"""A whole decomposition from a RunConfig: target → mesh → gate → state → train → results.

Front ends (the Hydra launcher, a notebook) call `decompose`; logging backends plug in
through `on_metrics`. Results land in `run_dir`: gate.json, summary.json, plots, checkpoints.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdecomp import gate as gate_lib
from pdecomp import metrics, plots, targets
from pdecomp.checkpoint import Checkpointer
from pdecomp.components import with_tied
from pdecomp.config import RunConfig, tied_sites, validate
from pdecomp.train import TrainState, faithfulness_warmup, init_state, make_train_step

EXIT_GATE_REFUSED = 3


class GateRefused(RuntimeError):
    def __init__(self, report: dict[str, Any]):
        self.report = report
        super().__init__(f"gate refused: predicted peak {report['peak_bytes'] / 2**30:.3f} GiB "
                         f"> cap {report['cap_bytes'] / 2**30:.3f} GiB per device")


@dataclass
class Hooks:
    """Callbacks a front end supplies; all optional."""

    log: Callable[[str], None] = print
    on_metrics: Callable[[int, dict[str, float]], None] | None = None
    on_gate: Callable[[dict[str, Any]], None] | None = None
    progress: Callable[[int, int, dict[str, float]], None] | None = None


def make_mesh(cfg: RunConfig) -> Mesh:
    """A 1-d data mesh: `mesh.data` devices, or the most devices that divide the batch."""
    devices = jax.devices()
    n = cfg.mesh.data or max(k for k in range(1, len(devices) + 1)
                             if cfg.data.batch_size % k == 0)
    return Mesh(np.array(devices[:n]), ("data",))


def write_json(path: Path, obj: Any) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_jsonable))
    tmp.replace(path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.generic, jax.Array)):
        return np.asarray(x).tolist()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x))


def _measured_peak(device: jax.Device) -> int | None:
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def decompose(cfg: RunConfig, run_dir: str | Path, hooks: Hooks | None = None) -> dict[str, Any]:
    """Run (or resume) the decomposition described by `cfg`; return the summary dict."""
    hooks = hooks or Hooks()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    validate(cfg, n_devices=len(jax.devices()))

    # The target: cached by its settings, trained and checked the first time.
    target, target_meta = targets.load_or_train_target(cfg.model, log=hooks.log)

    # Mesh and shardings: state and target replicated, the batch split on the data axis.
    mesh = make_mesh(cfg)
    replicated, batch_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    target = jax.device_put(target, replicated)
    # Each step's batch is sampled on the devices, already split on the data axis.
    sample = jax.jit(lambda k: targets.sample_inputs(k, cfg.model, cfg.data.batch_size),
                     out_shardings=batch_sharding)
    init_key, data_key = jax.random.split(jax.random.PRNGKey(cfg.seed))

    # Abstract state: shapes and shardings, nothing allocated.
    state_abs = jax.eval_shape(lambda k: init_state(k, cfg, target), init_key)
    state_abs = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), state_abs)
    batch_abs = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.model.n_features), jnp.float32,
                                     sharding=batch_sharding)

    # The gate: compile the very step training runs, read its memory, compare to the cap.
    cap, cap_source = gate_lib.device_cap_bytes(mesh.devices.flat[0], cfg.memory.hbm_cap_gib,
                                                cfg.memory.safety_fraction)
    parts = {"frozen target": gate_lib.tree_bytes(target),
             "components": gate_lib.tree_bytes(state_abs.components),
             "ci function": gate_lib.tree_bytes(state_abs.ci_fn),
             "optimizer moments": gate_lib.tree_bytes((state_abs.comp_opt, state_abs.ci_opt)),
             "step and key": gate_lib.tree_bytes((state_abs.step, state_abs.key)),
             "batch": gate_lib.tree_bytes(batch_abs, mesh.size)}
    step_fn = make_train_step(cfg)
    compiled, report = gate_lib.compile_and_report(
        step_fn, (state_abs, target, batch_abs),
        donate_argnums=(0,) if cfg.memory.donate else (),
        cap_bytes=cap, cap_source=cap_source, target=f"local {jax.default_backend()}",
        mesh=dict(mesh.shape), parts=parts)
    write_json(run_dir / "gate.json", report)
    if hooks.on_gate:
        hooks.on_gate(report)
    if not report["fits"]:
        raise GateRefused(report)
    if cfg.gate.only:
        return {"gate": report}

    # State: resume from the latest complete checkpoint, or initialise fresh.
    ckpt = Checkpointer(run_dir / "checkpoints")
    start = ckpt.latest_step()
    if start is not None:
        state = ckpt.restore(state_abs, start)
        hooks.log(f"resumed from checkpoint at step {start}")
    else:
        state = jax.jit(lambda k: init_state(k, cfg, target), out_shardings=replicated)(init_key)
        components = faithfulness_warmup(cfg, state.components, target)
        state = eqx.tree_at(lambda s: s.components, state, components)
        start = 0

    # Train with the gated executable. The data key for step i is fold_in(data_key, i), so a
    # resumed run sees the same batches as an uninterrupted one.
    # With more simulated CPU devices than cores, in-flight steps can starve the collective
    # rendezvous of threads; waiting on each step avoids that.
    sync_each = jax.default_backend() == "cpu" and mesh.size > 1
    steps, log_every = cfg.optim.steps, cfg.logging.log_every
    ckpt_every = cfg.logging.ckpt_every or steps
    history: list[dict[str, float]] = []
    last: dict[str, float] = {}
    if start and (run_dir / "history.json").exists():  # keep what the first attempt logged
        history = [h for h in json.loads((run_dir / "history.json").read_text())
                   if h["step"] <= start]
        last = dict(history[-1]) if history else {}
    t_log = time.perf_counter()
    for i in range(start, steps):
        batch = sample(jax.random.fold_in(data_key, i))
        state, m = compiled(state, target, batch)
        if sync_each:
            jax.block_until_ready(m)
        done = i + 1
        if done % log_every == 0 or done == steps:
            last = {k: float(v) for k, v in m.items()}
            if not all(math.isfinite(v) for v in last.values()):
                ckpt.close()
                raise FloatingPointError(f"non-finite loss at step {done}: {last}; the last "
                                         f"checkpoint in {ckpt.directory} is intact")
            now = time.perf_counter()
            n_steps = log_every if done % log_every == 0 else done % log_every
            last["perf/step_s"] = (now - t_log) / n_steps
            last["perf/examples_per_s"] = cfg.data.batch_size / last["perf/step_s"]
            t_log = now
            peak = _measured_peak(mesh.devices.flat[0])
            last["hbm/predicted_peak_gib"] = report["peak_bytes"] / gate_lib.GiB
            if peak is not None:
                last["hbm/peak_gib"] = peak / gate_lib.GiB
                last["hbm/in_use_gib"] = (mesh.devices.flat[0].memory_stats()["bytes_in_use"]
                                          / gate_lib.GiB)
            history.append({"step": done, **last})
            if hooks.on_metrics:
                hooks.on_metrics(done, last)
        if hooks.progress:
            hooks.progress(done, steps, last)
        if done % ckpt_every == 0 or done == steps:
            ckpt.save(done, state)
            write_json(run_dir / "history.json", history)
    ckpt.close()

    summary = evaluate(cfg, target, state, run_dir, hooks)
    if cfg.logging.plots and history:
        summary["plots/history"] = str(plots.plot_history(history, run_dir / "history.png"))
    summary.update({k: v for k, v in last.items() if k.startswith(("loss/", "perf/"))})
    summary["steps"] = int(state.step)
    summary["target/seed"] = target_meta.get("seed")
    peak = _measured_peak(mesh.devices.flat[0])
    if peak:
        report["measured_peak_bytes"] = int(peak)
        report["predicted_over_measured"] = report["peak_bytes"] / peak
        write_json(run_dir / "gate.json", report)
    write_json(run_dir / "summary.json", summary)
    write_json(run_dir / "history.json", history)
    return summary


def evaluate(cfg: RunConfig, target, state: TrainState, run_dir: Path,
             hooks: Hooks) -> dict[str, Any]:
    """Final metrics on fresh batches, the ground-truth match, and the plots."""
    thr = cfg.loss.ci_threshold
    components = with_tied(state.components, tied_sites(cfg))
    eval_key = jax.random.PRNGKey(cfg.seed + 10_000)
    batches = (targets.sample_inputs(jax.random.fold_in(eval_key, i), cfg.model,
                                     cfg.data.batch_size) for i in range(cfg.data.eval_batches))
    ci = metrics.ci_summary(target, components, state.ci_fn, batches, thr)
    summary: dict[str, Any] = {}
    for s, v in ci.items():
        summary[f"live/{s}"] = v["live"]
        summary[f"l0/{s}"] = v["l0"]
    if isinstance(target, targets.TMS):
        summary.update(metrics.tms_ground_truth(
            target, components, {s: v["max_ci"] > thr for s, v in ci.items()}))
    else:
        summary.update(metrics.resid_one_to_one(target, components, state.ci_fn, thr))
    if cfg.logging.plots:
        summary["plots/mean_ci"] = str(plots.plot_mean_ci(ci, run_dir / "mean_ci.png", thr))
        if isinstance(target, targets.TMS) and target.W.shape[1] == 2 \
                and "linear1" in components.sites:
            comp = components.sites["linear1"]
            V, U = np.asarray(comp.V), np.asarray(comp.U)
            scale = V[np.abs(V).argmax(0), np.arange(V.shape[1])]
            rows = U * scale[:, None]
            summary["plots/tms_directions"] = str(plots.plot_tms_directions(
                np.asarray(target.W), rows, ci["linear1"]["max_ci"] > thr,
                run_dir / "tms_directions.png"))
    return summary

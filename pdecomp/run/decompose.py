"""A whole decomposition, top to bottom: resolve → gate → state → train → evaluate.

Front ends (the Hydra launcher, a notebook) call `decompose`, with a `RunConfig` or the
`Run` that `prepare` resolved from one; logging backends plug in through `Hooks`. Results
land in `run_dir`: config.yaml, run.json, gate.json, history.json, summary.json, plots,
checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from pdecomp.core import hardware, sharding
from pdecomp.core.config import RunConfig
from pdecomp.gate.shapes import load_target
from pdecomp.gate.step import GateRefused, calibrate, gate, note_peak
from pdecomp.plan.files import RUN_FILE, write_config, write_json
from pdecomp.plan.resolve import Run, provenance, resolve, with_microbatch_size
from pdecomp.plan.validation import validate
from pdecomp.run.checkpoint import Checkpointer
from pdecomp.run.evaluation import Learned, draw, evaluate
from pdecomp.run.hooks import Hooks
from pdecomp.run.loop import (
    Interrupted,
    NonFiniteLoss,
    forecast_over_measured,
    initial_state,
    train,
)
from pdecomp.run.restore import check_resumable

__all__ = ["GateRefused", "Hooks", "Interrupted", "NonFiniteLoss", "decompose", "prepare"]


def prepare(cfg: RunConfig, run_dir: str | Path | None = None) -> Run:
    """The run `cfg` describes in this job, checked against what the job has (its devices,
    its files) before anything is made; ConfigError names the first problem. With
    `run_dir`: a checkpoint there, which the run would resume, must fit the state it builds."""
    # The allocator settings of the environment, before jax's GPU client would refuse them.
    hardware.usable_memory(cfg.memory.safety_fraction)
    deviceless = sharding.is_deviceless(cfg.gate)
    n_devices = None if deviceless else len(jax.devices())
    settled = with_microbatch_size(cfg, n_devices)
    validate(settled, n_devices)  # before the paths are made absolute: named as typed
    run = resolve(settled, n_devices, composed=cfg)
    sharding.check_target(run.config.gate)
    if not deviceless:
        sharding.make_mesh(run.placement)  # its checks: every process of the job has devices
    if not run.config.gate.only:  # the gate needs shapes only, not the data
        run.kind.preflight(run.config.model, run.config.data, run.config.seed)
    if run_dir is not None and not run.config.gate.only:
        check_resumable(run, Path(run_dir))
    return run


def decompose(run: Run | RunConfig, run_dir: str | Path, hooks: Hooks | None = None
              ) -> dict[str, Any]:
    """Run (or resume) the decomposition; return the summary dict.

    A file that cannot be written (a full disk) raises storage.WriteFailed, a checkpoint
    checkpoint.CheckpointWriteFailed: the last complete checkpoint is intact, and running
    again in `run_dir` resumes from it."""
    hooks, run_dir = hooks or Hooks(), Path(run_dir)
    run = prepare(run, run_dir) if isinstance(run, RunConfig) else run
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run, run_dir)

    g = gate(run, run_dir, hooks.detach_gate, hooks.log, hooks.temporaries_reused)
    write_json(run_dir / RUN_FILE, g.run.record())  # the batch the gate's search chose
    if hooks.on_gate:
        hooks.on_gate(g.report)
    if not g.report.fits:
        raise GateRefused(g.report)
    if g.run.config.gate.only:
        return {"gate": g.report.to_json()}
    target, target_meta = load_target(g.run, g.target_abs, hooks.log)
    note_peak(g, "target loaded")
    if hooks.on_target_loaded:
        hooks.on_target_loaded()
    ckpt = Checkpointer(run_dir / "checkpoints", writer=True,
                        quiet=hooks.quiet_checkpoint_failures)
    state, start = initial_state(g, target, ckpt, hooks.log)
    note_peak(g, "initial state")
    state, history = train(g, target, state, start, ckpt, run_dir, hooks)
    note_peak(g, "training")
    # Evaluation reads the components and the CI function alone: the optimizer's moments
    # and the adversary (in the last checkpoint) are let go before it allocates anything.
    steps, learned = int(state.step), Learned(state.components, state.ci_fn)
    del state

    summary: dict[str, Any] = {}
    if g.run.config.data.eval_batches:  # 0: a run evaluated later, or timed alone
        summary, evaluated = evaluate(g.run, target, learned, g.batch_sharding)
        note_peak(g, "evaluation")
        summary.update(draw(g.run, evaluated, history, run_dir))
    last = history[-1] if history else {}
    summary.update({k: v for k, v in last.items() if k.startswith(("loss/", "perf/"))})
    made_by = provenance()
    summary.update({"steps": steps, "target/seed": target_meta.get("seed"),
                    "pdecomp/version": made_by["pdecomp"], "pdecomp/commit": made_by["commit"]})
    if (ratio := forecast_over_measured(history)) is not None:
        summary["perf/forecast_over_measured"] = ratio
    if calibrate(g.report, g.mesh):  # the whole run's peak, evaluation included
        g.report.write(run_dir)
        summary["hbm/predicted_over_measured"] = g.report.predicted_over_measured
    write_json(run_dir / "summary.json", summary)
    write_json(run_dir / "history.json", history)
    return summary

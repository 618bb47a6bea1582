"""TMS 5-2 speed on this machine: step throughput at batch 4096 and a whole decomposition.

Prints a table with ratios against the public PyTorch implementation measured on the same
kind of 2-core machine (28 steps/s at its best setting; about 6 min for the 10k-step run).
Run: `make bench` (add `--no-full` to skip the whole-run timing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

from rich.console import Console
from rich.table import Table

TORCH_STEPS_PER_S = 28.0
TORCH_FULL_RUN_S = 6 * 60.0

STEP_SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys, time, jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from launcher import host
    from pdecomp.kinds import cache as targets
    from pdecomp.kinds import toy as toys
    from pdecomp.core.config import RunConfig
    from pdecomp.plan.resolve import resolve
    from pdecomp.spd.step import init_state, make_train_step
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, layers=dataclasses.replace(cfg.layers, ci_fn=sys.argv[1]))
    host.run_programs_inline()  # as a `pdecomp` job does for CPU training
    host.keep_freed_blocks()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    target = jax.device_put(targets.init_target(jax.random.PRNGKey(0), cfg.model), rep)
    spec = resolve(cfg).step
    state = jax.device_put(init_state(jax.random.PRNGKey(1), spec, target), rep)
    step = jax.jit(make_train_step(spec), donate_argnums=0)
    x = jax.device_put(toys.sample_inputs(jax.random.PRNGKey(2), cfg.model, 4096), shard)
    state, m = step(state, target, x); jax.block_until_ready(m)
    n, t = 300, time.perf_counter()
    for _ in range(n):
        state, m = step(state, target, x)
        jax.block_until_ready(m)
    print(json.dumps({"steps_per_s": n / (time.perf_counter() - t)}))
""")


def step_rate(n_devices: int, ci_fn: str = "mlp") -> float:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n_devices}"}
    out = subprocess.run([sys.executable, "-c", STEP_SCRIPT, ci_fn], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["steps_per_s"]


def full_run(cpu_devices: int) -> tuple[float, dict]:
    """`pdecomp` with the default experiment, target already cached (trained beforehand),
    on `cpu_devices` simulated CPU devices."""
    env = {**os.environ, "PDECOMP_CPU_DEVICES": str(cpu_devices)}
    with tempfile.TemporaryDirectory() as d:
        cmd = [os.path.join(os.path.dirname(sys.executable), "pdecomp"), "logging.progress=false"]
        subprocess.run([*cmd, "optim.steps=1", "logging.wandb.mode=disabled", f"hydra.run.dir={d}/warm"],
                       check=True, capture_output=True, env=env)
        t = time.perf_counter()
        subprocess.run([*cmd, f"hydra.run.dir={d}/run"], check=True, capture_output=True, env=env)
        wall = time.perf_counter() - t
        with open(f"{d}/run/summary.json") as f:
            summary = json.load(f)
    return wall, summary


def main() -> None:
    table = Table(title="TMS 5-2 decomposition speed (2-core CPU)")
    for col in ("measure", "pdecomp", "PyTorch SPD", "ratio"):
        table.add_column(col)
    for n in (1, 2):
        r = step_rate(n)
        table.add_row(f"steps/s, batch 4096, {n} CPU device(s)", f"{r:.1f}",
                      f"{TORCH_STEPS_PER_S:.0f}", f"{r / TORCH_STEPS_PER_S:.2f}x")
    # The same step with one shared MLP per site in place of the per-component CI MLPs:
    # what everything else costs, a bound on what a faster CI MLP could give.
    r = step_rate(1, "shared_mlp")
    table.add_row("  bound: layers.ci_fn=shared_mlp, 1 device", f"{r:.1f}", "", "")
    if "--no-full" not in sys.argv:
        # the default (one CPU device) and the host split into a device per core, where
        # the per-step collectives between simulated devices cost more than the split saves
        for label, n in (("whole default run, 10k steps (s)", 1),
                         ("  the same on 2 CPU devices (s)", 2)):
            wall, summary = full_run(n)
            table.add_row(label, f"{wall:.0f}", f"{TORCH_FULL_RUN_S:.0f}",
                          f"{TORCH_FULL_RUN_S / wall:.2f}x faster")
            table.add_row("    live linear1 / MMCS linear1", f"{summary.get('live/linear1')} / "
                          f"{summary.get('mmcs/linear1', float('nan')):.4f}", "", "")
    Console().print(table)


if __name__ == "__main__":
    main()

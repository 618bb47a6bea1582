"""In-process A/B of the LM step: variants compiled in one process, their readings alternated.

Whole jobs, one process per row (`bench_lm_cpu.py`), move by 5-15% with this 2-core host's
own speed from one minute to the next, so a change worth a few percent shows only when its
program and the baseline's run in one process, reading after reading. Each variant is
`bench_lm_cpu.py`'s SmolLM2 job with its own config overrides and XLA compile options; the
table gives each variant's median and range of s/step over the readings, and how far its
metrics on the first batch are from the first variant's (0 where only speed should differ).

Run: .venv/bin/python bench/ab_lm_step.py --ci-fn shared_mlp --variant base \
         --variant 'bf16:memory.matmul_dtype=bfloat16' \
         --variant 'no-ynn::xla_cpu_experimental_ynn_fusion_type=' [--model DIR --data FILE]
A variant is NAME[:OVERRIDE,...[:OPTION=VALUE,...]] (options: XLA's debug options, as
`jax.stages.Lowered.compile` takes them).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_lm_cpu import CI_FNS, job_args
from rich.console import Console
from rich.table import Table


def parse_variant(text: str) -> tuple[str, list[str], dict[str, Any]]:
    name, _, rest = text.partition(":")
    overrides, _, options = rest.partition(":")
    opts: dict[str, Any] = {}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        bools = {"true": True, "false": False}
        opts[key] = (bools[value.lower()] if value.lower() in bools
                     else int(value) if value.lstrip("-").isdigit() else value)
    return name, [o for o in overrides.split(",") if o], opts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ci-fn", choices=list(CI_FNS), default="shared_mlp")
    p.add_argument("--variant", action="append", required=True,
                   help="NAME[:OVERRIDE,...[:OPTION=VALUE,...]]; the first is the baseline")
    p.add_argument("--model", help="a Hugging Face directory (pdecomp convert)")
    p.add_argument("--data", help="a token file (pdecomp tokenize)")
    p.add_argument("--readings", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="steps per reading")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from launcher import host

    host.run_programs_inline()  # as a `pdecomp` job runs CPU programs
    from launcher import api
    from pdecomp.core import sharding
    from pdecomp.gate.shapes import load_target
    from pdecomp.gate.step import gate
    from pdecomp.plan.resolve import resolve
    from pdecomp.run.checkpoint import Checkpointer
    from pdecomp.run.loop import initial_state
    from pdecomp.spd.step import make_train_step

    variants, targets = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for text in args.variant:
            name, overrides, options = parse_variant(text)
            cfg = api.compose(["optim.steps=100", *job_args(args.ci_fn, args.model, args.data),
                               *overrides], preset="smollm2_l28")
            (Path(d) / name).mkdir()
            g = gate(resolve(cfg, len(jax.devices())), Path(d) / name, False, lambda s: None)
            key = str(jax.tree.map(lambda a: (a.shape, a.dtype), g.target_abs))
            if key not in targets:  # one copy of the frozen target per layout
                targets[key] = load_target(g.run, g.target_abs, print)[0]
            target = targets[key]
            ckpt = Checkpointer(Path(d) / name / "ckpt", writer=True)
            state, _ = initial_state(g, target, ckpt, print)
            r = g.run
            sample = r.kind.batch_sampler(r.model, r.data, r.seed, g.batch_sharding, g.data_key)
            # The gate's step (its layout pins the [*pos, C] tensors), without donation: every
            # reading starts from the same state.
            layout = sharding.make_layout(r.placement.mesh, g.mesh)
            step = jax.jit(make_train_step(r.step, layout)).lower(state, target, sample(0))
            variants[name] = (step.compile(options or None), state, target, sample)
    host.keep_freed_blocks()  # after loading, as `decompose` does

    first = {}
    for name, (step, state, target, sample) in variants.items():
        _, metrics = step(state, target, sample(0))
        first[name] = {k: float(v) for k, v in metrics.items() if jnp.ndim(v) == 0}
    base = next(iter(first.values()))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.readings):
        for name, (step, state, target, sample) in variants.items():
            t = time.perf_counter()
            for i in range(args.steps):
                _, metrics = step(state, target, sample(1 + i))
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - t) / args.steps)

    table = Table(title=f"LM step, {args.ci_fn}: {args.readings} alternated readings of "
                        f"{args.steps} steps, one process")
    for col in ("variant", "median s/step", "range", "vs first", "max |metric diff|"):
        table.add_column(col, justify="right")
    t0 = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        diff = max((abs(first[name][k] - base[k]) for k in base if k in first[name]),
                   default=float("nan"))
        med = statistics.median(ts)
        table.add_row(name, f"{med:.3f}", f"{min(ts):.3f}-{max(ts):.3f}", f"{med / t0:.3f}",
                      f"{diff:.3g}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()

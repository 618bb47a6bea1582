"""The test run's persistent compilation cache (conftest) changes no number: a run whose
every compile is a cache hit trains to the same bits and gates to the same figures as one
compiled from nothing, and the gate, which reads XLA's buffer assignment, compiles afresh
even when the cache holds its step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# jax_versions: the cache's format and keys are jax's own; slow: three whole runs, outside the
# quick tier (make test-fast)
pytestmark = [pytest.mark.jax_versions, pytest.mark.slow]

# A short TMS run through the library in a fresh process; its history, gate report and
# how many compiles the persistent cache served.
RUN = textwrap.dedent("""
    import dataclasses as dc, json, sys
    import jax

    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event.endswith("/cache_hits") else None)
    from pdecomp.core.config import RunConfig
    from pdecomp.run.decompose import decompose

    base = RunConfig()
    cfg = dc.replace(
        base, model=dc.replace(base.model, cache_dir=sys.argv[1], train_steps=300),
        optim=dc.replace(base.optim, steps=20, faith_warmup_steps=5),
        data=dc.replace(base.data, batch_size=256, eval_batches=1),
        logging=dc.replace(base.logging, log_every=5, plots=False))
    decompose(cfg, sys.argv[2])
    gate = json.load(open(sys.argv[2] + "/gate.json"))
    # every logged metric but the clock's (perf/)
    history = [{k: v for k, v in row.items() if not k.startswith("perf/")}
               for row in json.load(open(sys.argv[2] + "/history.json"))]
    print(json.dumps({"history": history, "gate": gate, "hits": len(hits)}))
""")


def _run(tmp_path: Path, name: str, cache: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    if cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    proc = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "targets"),
                           str(tmp_path / name)], env=env, capture_output=True, text=True,
                          check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cached_executables_give_the_numbers_and_gate_figures_of_a_fresh_compile(tmp_path):
    cache = tmp_path / "jax-cache"
    cold = _run(tmp_path, "cold", cache)  # compiles, fills the cache, trains the toy target
    assert any(cache.iterdir())
    warm = _run(tmp_path, "warm", cache)
    # the target's training, evaluation and the rest came from the cache
    assert warm["hits"] > cold["hits"]
    assert warm["history"] == cold["history"]  # to the bit
    for key in ("peak_bytes", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                "xla_peak_bytes", "largest_temps"):
        assert warm["gate"][key] == cold["gate"][key], key
    # the gate reads its temporaries from XLA's dump: a cache hit would have left it empty
    assert warm["gate"]["largest_temps"]

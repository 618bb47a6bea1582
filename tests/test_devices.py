"""Data parallelism must not change the numbers: 1 vs 8 simulated CPU devices."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from conftest import run_on_cpu_devices

# jax_versions: the step's numbers on 1 and 8 devices; slow: 25 s of 8-device processes, outside
# the quick tier (make test-fast)
pytestmark = [pytest.mark.jax_versions, pytest.mark.slow]

SCRIPT = textwrap.dedent("""
    import json, sys, dataclasses as dc
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pdecomp.kinds import cache as targets
    from pdecomp.kinds import toy as toys
    from pdecomp.spd import losses
    from pdecomp.core.config import RunConfig
    from pdecomp.spd.ci import ci_upper
    from conftest import train_on_all_devices

    mesh = Mesh(np.array(jax.devices()), ("data",))
    shard = NamedSharding(mesh, P("data"))
    out = {"n_devices": len(jax.devices())}

    # imp-min on a batch-sharded CI tensor, with beta > 0 so the global sum matters.
    logits = jax.random.normal(jax.random.PRNGKey(0), (64, 16, 20)) + 0.3
    ci = jax.device_put(ci_upper(logits), shard)
    f = jax.jit(lambda c: losses.importance_minimality({"s": c}, 0.9, 1e-6, 0.2))
    out["imp_min"] = float(f(ci))

    # Five whole train steps of TMS 5-2 (an untrained target is enough to compare numbers).
    cfg = RunConfig()
    cfg = dc.replace(cfg, data=dc.replace(cfg.data, batch_size=512))
    batches = [toys.sample_inputs(jax.random.PRNGKey(10 + i), cfg.model, 512)
               for i in range(5)]
    _, out["history"] = train_on_all_devices(cfg, 1, 2, batches)
    print(json.dumps(out))
""")


def _run(n: int) -> dict:
    return run_on_cpu_devices(SCRIPT, n)


def test_imp_min_and_train_steps_match_on_1_and_8_devices():
    one, eight = _run(1), _run(8)
    assert one["n_devices"] == 1 and eight["n_devices"] == 8
    np.testing.assert_allclose(eight["imp_min"], one["imp_min"], rtol=1e-5)
    for a, b in zip(one["history"], eight["history"]):
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-9, err_msg=k)


FSDP_SCRIPT = textwrap.dedent("""
    import json, sys, dataclasses as dc
    import jax
    from pdecomp.core.config import ResidMLPConfig, RunConfig
    from pdecomp.run.decompose import decompose

    base = RunConfig()
    out = {}
    for shard in (False, True):
        cfg = dc.replace(base,
            model=ResidMLPConfig(name="rm", n_features=16, d_embed=64, d_hidden=32,
                                 train_steps=200, cache_dir=sys.argv[1]),
            layers=dc.replace(base.layers, sites=["layers.0.mlp_in", "layers.0.mlp_out"], C=16),
            optim=dc.replace(base.optim, steps=6, faith_warmup_steps=5),
            data=dc.replace(base.data, batch_size=256, eval_batches=1),
            mesh=dc.replace(base.mesh, shard_state=shard),
            gate=dc.replace(base.gate, top_temps=0),
            logging=dc.replace(base.logging, log_every=1, plots=False))
        decompose(cfg, f"{sys.argv[1]}/run-{shard}")
        out[str(shard)] = json.load(open(f"{sys.argv[1]}/run-{shard}/history.json"))
    print(json.dumps(out))
""")


def test_fsdp_state_sharding_keeps_the_numbers(tmp_path):
    """Sharding target, components and optimizer moments over 8 devices (mesh.shard_state)
    changes where the bytes live, not the loss trajectory."""
    out = run_on_cpu_devices(FSDP_SCRIPT, 8, str(tmp_path))
    replicated, sharded = out["False"], out["True"]
    assert len(replicated) == len(sharded) == 6
    for a, b in zip(replicated, sharded):
        for k in ("loss/total", "loss/imp_min", "loss/recon_full"):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, err_msg=k)

"""Mesh layouts and memory plans move bytes, not numbers: llama_tiny's step (chunkwise
uniform-k recon, persistent PGD, global CI transformer) on 8 CPU devices as data 8 x model 1
and data 2 x model 4 (components split along C), and data 4 x model 2 with the weights
whole on each data replica, with the CI streamed, layers
rematerialized and the batch in microbatches (and, on 2 x 4, the optimizer moments kept in
host memory), against the plain single-device step."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from conftest import run_on_cpu_devices

# 36 s of 8-device processes: outside the quick tier (make test-fast)
pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, dataclasses as dc
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from pdecomp.kinds import cache as targets
    from pdecomp.core.sharding import OFFLOADED, Layout, place, shardings
    from pdecomp.plan.resolve import resolve
    from pdecomp.spd.step import init_state, make_train_step, scalars
    from test_lm import tiny_cfg, tokens
    from test_microbatches import LINEAR_ADAM

    cfg = tiny_cfg(scope="per_position")
    layers = dc.replace(cfg.layers, ci_fn="global_transformer", ci_d_model=16, ci_blocks=1,
                        ci_heads=2, ci_mlp=32)
    cfg = dc.replace(cfg, layers=layers, data=dc.replace(cfg.data, batch_size=8),
                     optim=dc.replace(cfg.optim, components=LINEAR_ADAM, ci_fn=LINEAR_ADAM))
    target = targets.init_target(jax.random.PRNGKey(0), cfg.model)
    spec = resolve(cfg).step
    state = init_state(jax.random.PRNGKey(1), spec, target)
    batch = tokens(cfg)

    def leaves(tree):  # {path: values} of the floating leaves
        return {jax.tree_util.keystr(p): np.asarray(x, np.float64).tolist()
                for p, x in jax.tree_util.tree_leaves_with_path(tree)
                if jnp.issubdtype(x.dtype, jnp.floating)}

    def run(cfg, layout):
        spec = resolve(cfg).step
        if layout is None:
            new, m = jax.jit(make_train_step(spec))(state, target, batch)
            return {"metrics": scalars(m, spec.sites.names), "state": leaves(new)}
        offload = OFFLOADED if cfg.memory.offload_opt_state else ()
        s_abs, t_abs = place(state, layout, offload), place(target, layout)
        specs = {str(x.sharding.spec) for x in jax.tree.leaves(s_abs)}
        step = jax.jit(make_train_step(spec, layout),
                       out_shardings=(shardings(s_abs), NamedSharding(layout.mesh, P())))
        new, m = step(jax.device_put(state, shardings(s_abs)),
                      jax.device_put(target, shardings(t_abs)),
                      jax.device_put(batch, NamedSharding(layout.mesh, P("data"))))
        return {"metrics": scalars(m, spec.sites.names), "state": leaves(new),
                "specs": sorted(specs),
                "moments_in": sorted({x.sharding.memory_kind for x in
                                      jax.tree.leaves((new.comp_opt, new.ci_opt))}),
                "components_in": sorted({x.sharding.memory_kind for x in
                                         jax.tree.leaves(new.components)})}

    def plan(cfg, microbatches=1, offload=False):
        return dc.replace(cfg, memory=dc.replace(cfg.memory, stream_ci=True,
                                                 remat_layers=True, remat="full",
                                                 offload_opt_state=offload),
                          optim=dc.replace(cfg.optim, microbatches=microbatches))

    devices = np.array(jax.devices())
    out = {"old": leaves(state),
           "single": run(cfg, None),
           "8x1": run(plan(cfg), Layout(Mesh(devices.reshape(8, 1), ("data", "model")),
                                        {"batch": "data", "comp": "model"}, fsdp=True)),
           "2x4": run(plan(cfg, 2, offload=True), Layout(Mesh(devices.reshape(2, 4), ("data", "model")),
                                           {"batch": "data", "comp": "model"}, fsdp=True)),
           # the weights whole on each data replica, the moments split (mesh.shard_weights)
           "4x2-zero1": run(plan(cfg, 2), Layout(Mesh(devices.reshape(4, 2), ("data", "model")),
                                                 {"batch": "data", "comp": "model"}, fsdp=True,
                                                 fsdp_weights=False))}
    print(json.dumps(out))
""")


def test_layouts_and_memory_plans_give_the_single_device_step():
    out = run_on_cpu_devices(SCRIPT, 8)
    ref = out["single"]
    # the 2 x 4 layout really splits components on the model axis
    assert any("'model'" in s for s in out["2x4"]["specs"]), out["2x4"]["specs"]
    # offloaded moments come back to host memory, the rest stays on the devices
    assert out["2x4"]["moments_in"] == ["pinned_host"], out["2x4"]["moments_in"]
    assert out["2x4"]["components_in"] == ["device"], out["2x4"]["components_in"]
    assert out["8x1"]["moments_in"] == ["device"], out["8x1"]["moments_in"]
    for name in ("8x1", "2x4", "4x2-zero1"):
        got = out[name]
        for k, v in ref["metrics"].items():
            np.testing.assert_allclose(got["metrics"][k], v, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}: {k}")
        # the updates (state - old state), leaf by leaf, against the largest update
        assert set(got["state"]) == set(ref["state"])
        for path, a in ref["state"].items():
            o, b = out["old"][path], got["state"][path]
            d_ref, d_got = np.subtract(a, o), np.subtract(b, o)
            # The adversary ascends by Adam with eps 1e-8 (sign-like): its leaves compare
            # against their own scale, every other leaf against its update's.
            adversary = path.startswith(".adversary")
            scale = max(np.abs(a if adversary else d_ref).max(), 1e-6)
            err = np.abs(d_got - d_ref).max() / scale
            assert err <= 1e-5, f"{name}: {path}: relative error {err:.2e}"

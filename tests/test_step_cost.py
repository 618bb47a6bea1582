"""The step's cost read from XLA's partitioned module (pdecomp.gate.step_cost): a small sharded
step of known collectives counted by hand, and the roofline made of them."""

from __future__ import annotations

import pytest
from conftest import run_on_cpu_devices

from pdecomp.core import hardware
from pdecomp.gate import step_cost

LAYERS, ROWS, D = 3, 32, 64  # a scan of 3 layers; x [32, 64]; W [3, 64, 64]

# On a 4 x 2 (data x model) mesh of 8 CPU devices, 2 "hosts" of 4: per layer, the weight
# all-gathered over data, the product summed over model, scattered over data, permuted
# over model. Printed: step_cost.measure of the compiled step.
STEP = f"""
import json
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from pdecomp.gate import step_cost

mesh = jax.make_mesh((4, 2), ("data", "model"))

def layers(x, W):
    def body(x, w):
        full = jax.lax.all_gather(w, "data", axis=0, tiled=True)
        y = jax.lax.psum(x @ full, "model")
        r = jax.lax.psum_scatter(y, "data", scatter_dimension=1, tiled=True)
        p = jax.lax.ppermute(r, "model", perm=[(0, 1), (1, 0)])
        return x * jnp.mean(p), None
    return jax.lax.scan(body, x, W)[0]

step = jax.jit(jax.shard_map(layers, mesh=mesh, in_specs=(P("data"), P(None, "data", "model")),
                             out_specs=P("data"), check_vma=False))
x = jax.ShapeDtypeStruct(({ROWS}, {D}), jnp.float32, sharding=NamedSharding(mesh, P("data")))
W = jax.ShapeDtypeStruct(({LAYERS}, {D}, {D}), jnp.float32,
                         sharding=NamedSharding(mesh, P(None, "data", "model")))
print(json.dumps(step_cost.measure(step.lower(x, W).compile().as_text(), 8, hosts=2)))
"""


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_on_cpu_devices(STEP, 8)


@pytest.mark.jax_versions  # XLA prints replica groups differently from one jax to the next
def test_collective_bytes_of_a_sharded_step_match_a_hand_count(measured: dict) -> None:
    f32, data, model = 4, 4, 2
    rows, w_cols = ROWS // data, D // model  # per device
    gathered = D * w_cols * f32  # the weight after its all-gather over data
    summed = rows * w_cols * f32  # x @ W, all-reduced over model
    scattered = summed // data  # reduce-scattered over data, then permuted
    want = {  # per layer, what each device sends (and receives) in the ring algorithms
        "all-gather": (gathered * (data - 1) / data, True),  # data spans both hosts
        "all-reduce": (2 * summed * (model - 1) / model, False),  # model stays within one
        "reduce-scatter": (scattered * (data - 1), True),
        "collective-permute": (scattered, False),
    }
    got = measured["collectives"]
    assert sorted(got) == sorted(want)
    for kind, (per_layer, crosses) in want.items():
        assert got[kind]["count"] == LAYERS, kind  # the loop's body, as often as it runs
        assert got[kind]["bytes"] == LAYERS * per_layer, kind
        assert got[kind]["network_bytes"] == (LAYERS * per_layer if crosses else 0), kind
    assert measured["flops"] == LAYERS * 2 * rows * D * w_cols  # x @ W per device
    assert measured["hbm_bytes"] >= LAYERS * (gathered + summed)  # at least those written


def test_the_roofline_names_what_bounds_the_step(measured: dict) -> None:
    b200 = hardware.GPUS["b200"]
    r = step_cost.roofline(measured, b200)
    network = sum(c["network_bytes"] for c in measured["collectives"].values())
    nvlink = sum(c["bytes"] for c in measured["collectives"].values()) - network
    assert r["network_s"] == pytest.approx(nvlink / b200.nvlink_bandwidth
                                           + network / b200.network_bandwidth)
    assert measured["f32_flops"] == measured["flops"]  # a float32 product: TF32's rate
    assert r["compute_s"] == pytest.approx(measured["flops"] / b200.tf32_flops)
    half = {**measured, "f32_flops": measured["flops"] // 2}  # half of it on bf16 operands
    assert step_cost.roofline(half, b200)["compute_s"] == pytest.approx(
        measured["flops"] / 2 / b200.bf16_flops + measured["flops"] / 2 / b200.tf32_flops)
    assert r["roofline_s"] == max(r["compute_s"], r["hbm_s"], r["network_s"])
    assert r["bound"] == "network"  # a few KB of matmul against a cross-host all-gather
    assert r["serial_s"] == pytest.approx(r["compute_s"] + r["network_s"])


def test_hbm_bytes_of_a_loop_free_step_are_xlas_own() -> None:
    """Without loops, the bytes each top-level instruction reads and writes are what XLA's
    cost analysis counts (which counts a loop's body once: hence our own count)."""
    import jax
    import jax.numpy as jnp

    def grads(W1, W2, x):
        def loss(W1, W2):
            return jnp.mean(jnp.tanh(jnp.tanh(x @ W1) @ W2) ** 2)
        return jax.grad(loss, argnums=(0, 1))(W1, W2)

    shapes = ((512, 1024), (1024, 512), (256, 512))
    compiled = jax.jit(grads).lower(*(jax.ShapeDtypeStruct(s, jnp.float32)
                                      for s in shapes)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    mine = step_cost.measure(compiled.as_text(), 1)
    assert mine["hbm_bytes"] == pytest.approx(cost["bytes accessed"], rel=1e-4)
    assert mine["flops"] == 3 * 2 * (256 * 512 * 1024 + 256 * 1024 * 512) - 2 * 256 * 512 * 1024
    assert mine["collectives"] == {}


def test_a_loops_body_counts_as_often_as_it_runs() -> None:
    """A scan of 6 layers, forward and backward: 3 matmuls a layer, 6 times (XLA's own cost
    analysis counts the body once)."""
    import jax
    import jax.numpy as jnp

    def grads(Ws, x):
        def loss(Ws):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, Ws)
            return jnp.mean(h ** 2)
        return jax.grad(loss)(Ws)

    compiled = jax.jit(grads).lower(jax.ShapeDtypeStruct((6, 512, 512), jnp.float32),
                                    jax.ShapeDtypeStruct((256, 512), jnp.float32)).compile()
    cost = step_cost.measure(compiled.as_text(), 1)
    assert cost["flops"] == cost["f32_flops"] == 6 * 3 * 2 * 256 * 512 * 512

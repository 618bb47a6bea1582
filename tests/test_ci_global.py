"""The `global_transformer` CI function (pdecomp/spd/ci_global.py) at tiny sizes."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on_cpu_devices

from pdecomp.spd.ci_global import GlobalCITransformer, global_transformer_param_count

D_IN = {"a": 5, "b": 8, "c": 3}
C = {"a": 4, "b": 2, "c": 7}
SIZES = {"d_model": 16, "n_blocks": 2, "n_heads": 4, "d_mlp": 32}
B, T = 2, 6


@pytest.fixture(scope="module")
def net() -> GlobalCITransformer:
    return GlobalCITransformer.init(jax.random.key(0), D_IN, C, **SIZES)


def inputs(key: int = 1, lead: tuple[int, ...] = (B, T), dtype=jnp.float32) -> dict:
    keys = jax.random.split(jax.random.key(key), len(D_IN))
    return {s: jax.random.normal(k, (*lead, d), dtype) for k, (s, d) in zip(keys, D_IN.items())}


@eqx.filter_jit
def fwd(n: GlobalCITransformer, x: dict) -> dict:
    return n(x, None)


def max_diff(x: dict, y: dict) -> float:
    return max(float(jnp.max(jnp.abs(x[s] - y[s]))) for s in x)


def test_shapes_dtype_and_site_order(net):
    out = fwd(net, inputs())
    assert list(out) == list(C)
    for s, c in C.items():
        assert out[s].shape == (B, T, c)
        assert out[s].dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(out[s])))
    # extra leading batch axes are carried through
    x = inputs(lead=(3, B, T))
    out = fwd(net, x)
    assert all(out[s].shape == (3, B, T, C[s]) for s in C)
    flat = fwd(net, {s: v.reshape(3 * B, T, -1) for s, v in x.items()})
    assert max_diff({s: v.reshape(3 * B, T, -1) for s, v in out.items()}, flat) < 1e-5


def test_bidirectional(net):
    x = inputs()
    y = dict(x, b=x["b"].at[:, -1].add(1.0))
    out, out2 = fwd(net, x), fwd(net, y)
    # the last position's input reaches position 0 (no causal mask)
    assert max(float(jnp.max(jnp.abs(out[s][:, 0] - out2[s][:, 0]))) for s in C) > 1e-4
    # the batch elements stay independent
    x2 = dict(x, b=x["b"].at[1].add(1.0))
    out3 = fwd(net, x2)
    assert max(float(jnp.max(jnp.abs(out[s][0] - out3[s][0]))) for s in C) == 0.0


def test_position_order_matters(net):
    """Attention without positions would be permutation-equivariant; RoPE breaks that."""
    x = inputs()
    perm = jnp.array([3, 0, 5, 1, 4, 2])
    out = fwd(net, x)
    out_p = fwd(net, {s: v[:, perm] for s, v in x.items()})
    unpermuted = {s: out_p[s][:, jnp.argsort(perm)] for s in C}
    assert max_diff(out, unpermuted) > 1e-4


def test_input_norm_is_weightless_per_site(net):
    x = inputs()
    out = fwd(net, x)
    for s in D_IN:
        scaled = fwd(net, dict(x, **{s: 7.0 * x[s]}))
        assert max_diff(out, scaled) < 1e-5
    # but the direction of a site's input matters
    changed = fwd(net, dict(x, a=x["a"] + 1.0))
    assert max_diff(out, changed) > 1e-4


def test_gradient_reaches_every_parameter(net):
    x = inputs()
    targets = {s: jax.random.normal(jax.random.key(9), (B, T, C[s])) for s in C}

    def loss(n):
        out = n(x, None)
        return sum(jnp.sum((out[s] - targets[s]) ** 2) for s in C)

    grads = eqx.filter_jit(eqx.filter_grad(loss))(net)
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(grads, eqx.is_array))
    # 10 shared, an input projection and a logit head (w, b) per group (here, per site)
    assert len(leaves) == 10 + 3 * len(C)
    for path, g in leaves:
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), path
        if g.ndim >= 2 and g.shape[0] == SIZES["n_blocks"]:  # stacked blocks: each block
            norms = np.sqrt((g.reshape(g.shape[0], -1) ** 2).sum(-1))
            assert np.all(norms > 0), (path, norms)
        else:
            assert np.any(g != 0), path


def test_blocks_are_residual(net):
    """With the blocks' output projections zeroed every block is the identity: the logits are
    the input linear, the final norm and the logit linear alone."""
    zeroed = eqx.tree_at(lambda n: (n.wo, n.w_down), net,
                         (jnp.zeros_like(net.wo), jnp.zeros_like(net.w_down)))
    x = inputs()
    normed = [v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-6) for v in x.values()]
    w_in = jnp.concatenate([net.layout.unstack(net.w_in)[s] for s in C])  # rows per site
    h = jnp.concatenate(normed, -1) @ w_in + net.b_in
    h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * net.final_norm
    w, b = net.layout.unstack(net.w_out), net.layout.unstack(net.b_out)  # per site
    logits = h @ jnp.concatenate([w[s] for s in C], -1) + jnp.concatenate([b[s] for s in C])
    expected = dict(zip(C, jnp.split(logits, [4, 6], axis=-1), strict=True))
    assert max_diff(fwd(zeroed, x), expected) < 1e-5


def test_bf16_inputs_give_fp32_logits(net):
    x = inputs()
    out = fwd(net, x)
    out16 = fwd(net, {s: v.astype(jnp.bfloat16) for s, v in x.items()})
    for s in C:
        assert out16[s].dtype == jnp.float32
        assert out16[s].shape == out[s].shape
    assert max_diff(out, out16) < 0.05


def test_jit_matches_eager(net):
    x = inputs()
    assert max_diff(net(x, None), fwd(net, x)) < 1e-5


def test_no_position_axis(net):
    x = inputs(lead=(B,))
    out = fwd(net, x)
    assert all(out[s].shape == (B, C[s]) and out[s].dtype == jnp.float32 for s in C)
    as_len1 = fwd(net, {s: v[:, None, :] for s, v in x.items()})
    assert max_diff(out, {s: v[:, 0] for s, v in as_len1.items()}) < 1e-6


def test_params_fp32_and_count(net):
    leaves = jax.tree.leaves(eqx.filter(net, eqx.is_array))
    assert all(p.dtype == jnp.float32 for p in leaves)
    n = sum(p.size for p in leaves)
    assert n == global_transformer_param_count(D_IN, C, SIZES["d_model"], SIZES["n_blocks"],
                                               SIZES["d_mlp"])


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="divisible"):
        GlobalCITransformer.init(jax.random.key(0), D_IN, C, d_model=18, n_blocks=1,
                                 n_heads=4, d_mlp=8)
    with pytest.raises(ValueError, match="same sites"):
        GlobalCITransformer.init(jax.random.key(0), D_IN, {"b": 2, "a": 4, "c": 7},
                                 d_model=16, n_blocks=1, n_heads=4, d_mlp=8)


def test_site_order_follows_mappings():
    """Concatenation in the order of d_in, output split in the order of C: swapping which
    site comes first changes which slice of w_out each site reads."""
    net = GlobalCITransformer.init(jax.random.key(0), D_IN, C, **SIZES)
    d = SIZES["d_model"]
    w_out = jnp.zeros((d, sum(C.values()))).at[:, C["a"]:C["a"] + C["b"]].set(1.0)
    b_out = jnp.arange(sum(C.values()), dtype=jnp.float32)
    split = [C["a"], C["a"] + C["b"]]
    net = eqx.tree_at(lambda n: (n.w_out, n.b_out), net,
                      (net.layout.stack(dict(zip(net.sites, jnp.split(w_out, split, 1)))),
                       net.layout.stack(dict(zip(net.sites, jnp.split(b_out, split))))))
    out = fwd(net, inputs())
    # site "a" owns columns 0..3 (bias only), "b" owns 4..5 (reads w_out), "c" owns 6..12
    np.testing.assert_allclose(out["a"], jnp.broadcast_to(b_out[:4], (B, T, 4)), atol=0)
    np.testing.assert_allclose(out["c"], jnp.broadcast_to(b_out[6:], (B, T, 7)), atol=0)
    assert float(jnp.max(jnp.abs(out["b"] - b_out[4:6]))) > 0.1


FSDP_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, equinox as eqx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from pdecomp.spd.ci_global import GlobalCITransformer
from pdecomp.core.sharding import AXIS, Layout
D_IN, C = {"a": 5, "b": 8, "c": 3}, {"a": 4, "b": 2, "c": 8}
net = GlobalCITransformer.init(jax.random.key(0), D_IN, C, d_model=16, n_blocks=2,
                               n_heads=4, d_mlp=32)
mesh = Mesh(np.array(jax.devices()), (AXIS,))
params, static = eqx.partition(net, eqx.is_array)
layout = Layout(mesh, {}, fsdp=True)
shard = lambda p: jax.device_put(p, NamedSharding(mesh, layout.spec((None,) * p.ndim, p.shape)))
sharded = eqx.combine(jax.tree.map(shard, params), static)
assert any(p.sharding.spec != P() for p in jax.tree.leaves(eqx.filter(sharded, eqx.is_array)))
keys = jax.random.split(jax.random.key(1), 3)
x = {s: jax.random.normal(k, (4, 6, d)) for k, (s, d) in zip(keys, D_IN.items())}
xs = {s: jax.device_put(v, NamedSharding(mesh, P(AXIS))) for s, v in x.items()}
def loss(n, x):
    return sum(jnp.sum(v ** 2) for v in n(x, None).values())
ref_l, ref_g = eqx.filter_value_and_grad(loss)(net, x)
l, g = eqx.filter_jit(eqx.filter_value_and_grad(loss))(sharded, xs)
assert abs(float(l) - float(ref_l)) < 1e-4 * abs(float(ref_l)), (l, ref_l)
for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
print('"ok"')
"""


def test_fsdp_sharded_state():
    assert run_on_cpu_devices(FSDP_SCRIPT, 4) == "ok"

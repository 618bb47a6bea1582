"""Invariants of docs/method.md that a bug could break."""

from __future__ import annotations

import dataclasses as dc
from functools import reduce

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdecomp.core.config import RunConfig, TMSConfig
from pdecomp.kinds.cache import init_target
from pdecomp.spd import losses
from pdecomp.spd.ci import ALPHA, ci_lower, ci_upper
from pdecomp.spd.components import (
    Components,
    Groups,
    SiteComponents,
    SiteMask,
    dot,
    einsum,
    frozen_linear,
    masked_linear,
    with_tied,
)
from pdecomp.spd.masks import make_plan, masks_from_sources, sample_routing, sample_source
from pdecomp.spd.step import faithfulness
from pdecomp.targets.toy_models import TMS

pytestmark = pytest.mark.jax_versions  # the method's numbers: random bits, custom gradients, the step

X = jnp.array([-2.0, -0.5, 0.0, 0.3, 1.0, 1.5, 3.0])


def test_ci_lower_forward_is_clamp():
    np.testing.assert_allclose(ci_lower(X), jnp.clip(X, 0, 1))


@pytest.mark.parametrize("g", [1.0, -1.0])
def test_ci_lower_backward_leaks_only_upward_below_zero(g):
    _, vjp = jax.vjp(ci_lower, X)
    (grad,) = vjp(jnp.full_like(X, g))
    inside = (X > 0) & (X <= 1)
    below = X <= 0
    expected = np.where(inside, g, np.where(below & (g < 0), ALPHA * g, 0.0))
    np.testing.assert_allclose(grad, expected)
    assert grad[-1] == 0.0 and grad[-2] == 0.0  # nothing above 1


def test_ci_upper_forward_and_plain_gradient():
    expected = np.where(X > 1, 1 + ALPHA * (X - 1), np.clip(X, 0, 1))
    np.testing.assert_allclose(ci_upper(X), expected, rtol=1e-6)
    off_kinks = jnp.array([-2.0, -0.5, 0.3, 0.9, 1.5, 3.0])
    grad = jax.grad(lambda x: jnp.sum(ci_upper(x)))(off_kinks)
    np.testing.assert_allclose(grad, [0.0, 0.0, 1.0, 1.0, ALPHA, ALPHA], rtol=1e-6)


@pytest.mark.parametrize("shape", [(7, 5), (4096, 21), (3, 4, 5)])
def test_fused_threefry_draws_are_jax_randoms_bits(shape):
    from pdecomp.core import threefry

    for key in (jax.random.PRNGKey(3), jax.random.key(4)):
        np.testing.assert_array_equal(threefry.uniform(key, shape), jax.random.uniform(key, shape))
        np.testing.assert_array_equal(threefry.uniform(key, shape, -1.0, 1.0),
                                      jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0))
        np.testing.assert_array_equal(threefry.bernoulli(key, 0.05, shape),
                                      jax.random.bernoulli(key, 0.05, shape))
    # and they are the straight-line hash, not jax's rolled CPU loop
    def cpu_program(draw):
        traced = jax.jit(lambda k: draw(k, shape)).trace(jax.random.PRNGKey(0))
        return traced.lower(lowering_platforms=("cpu",)).as_text()

    assert "while" not in cpu_program(threefry.uniform)
    assert "while" in cpu_program(jax.random.uniform)


def test_mask_interpolates_and_delta_mask_is_raw_source():
    ci = {"a": jnp.array([[0.0, 0.5, 1.0]])}
    src = {"a": jnp.array([[0.2, 0.4, 0.6, 0.7]])}
    m = masks_from_sources(ci, src, {"a": None}, delta=True)["a"]
    np.testing.assert_allclose(m.mask, [[0.2, 0.5 + 0.5 * 0.4, 1.0]], rtol=1e-6)
    np.testing.assert_allclose(m.delta_mask, [0.7])  # never interpolated with CI
    assert masks_from_sources(ci, src, {"a": None}, delta=False)["a"].delta_mask is None


def test_sources_are_in_range_and_binomial_is_binary():
    key = jax.random.PRNGKey(0)
    c = sample_source(key, "continuous", (1000, 5))
    assert float(c.min()) >= 0.0 and float(c.max()) <= 1.0 and 0.45 < float(c.mean()) < 0.55
    b = sample_source(key, "binomial", (1000, 5))
    assert set(np.unique(np.asarray(b))) <= {0.0, 1.0} and 0.45 < float(b.mean()) < 0.55


def _tms(n=5, m=2, hidden=0):
    return init_target(jax.random.PRNGKey(0), TMSConfig(n_features=n, d_hidden=m,
                                                          n_hidden_layers=hidden))


def test_all_ones_mask_with_full_delta_reproduces_target():
    """mask = 1 on every channel and delta mask 1 gives V@U + (W − V@U) = W exactly."""
    target = _tms()
    comps = Components.init(jax.random.PRNGKey(1), {"linear1": (5, 2), "linear2": (2, 5)},
                            {"linear1": 7, "linear2": 7})
    x = jax.random.uniform(jax.random.PRNGKey(2), (16, 5))
    masks = {s: SiteMask(jnp.ones((16, 7)), jnp.ones((16,)), None) for s in comps.sites}
    np.testing.assert_allclose(target(x, masked_linear(comps, masks)), target(x), atol=1e-5)


def test_site_not_live_gets_zero_component_gradient():
    target = _tms()
    comps = Components.init(jax.random.PRNGKey(1), {"linear1": (5, 2), "linear2": (2, 5)},
                            {"linear1": 4, "linear2": 4})
    x = jax.random.uniform(jax.random.PRNGKey(2), (16, 5))

    def loss(c):
        # (mask = delta mask would make the live site's output 0.5 W x, free of V and U)
        masks = {"linear1": SiteMask(jnp.full((16, 4), 0.7), jnp.full((16,), 0.5), None)}
        return jnp.sum(target(x, masked_linear(c, masks)) ** 2)

    g = jax.grad(loss)(comps)
    assert float(jnp.abs(g.sites["linear2"].V).max()) == 0.0
    assert float(jnp.abs(g.sites["linear2"].U).max()) == 0.0
    assert float(jnp.abs(g.sites["linear1"].V).max()) > 0.0


def test_unrouted_positions_take_the_frozen_path():
    comps = Components.init(jax.random.PRNGKey(1), {"s": (3, 4)}, {"s": 2})
    W = jax.random.normal(jax.random.PRNGKey(3), (3, 4))
    x = jax.random.normal(jax.random.PRNGKey(4), (6, 3))
    routed = jnp.array([True, False, True, False, False, True])
    m = SiteMask(jnp.zeros((6, 2)), jnp.zeros((6,)), routed)
    y = masked_linear(comps, {"s": m})("s", x, W)
    np.testing.assert_allclose(y[~np.asarray(routed)], frozen_linear("s", x, W)[~routed],
                               rtol=1e-6)
    np.testing.assert_allclose(y[np.asarray(routed)], 0.0, atol=1e-6)  # zero mask, no delta


def test_live_site_computes_the_delta_channel_as_written():
    """The site's output and its gradients (components, masks, delta source) equal the
    semantics as written, ((x @ V) * mask) @ U + (x @ (W − V@U)) * delta_mask with the
    frozen x @ W where unrouted, though it is computed without forming W − V@U."""
    comps = Components.init(jax.random.PRNGKey(1), {"s": (12, 20)}, {"s": 9})
    W = jax.random.normal(jax.random.PRNGKey(3), (12, 20))
    x = jax.random.normal(jax.random.PRNGKey(4), (32, 12))
    mask = jax.random.uniform(jax.random.PRNGKey(5), (32, 9))
    delta = jax.random.uniform(jax.random.PRNGKey(6), (32,))
    routed = jax.random.bernoulli(jax.random.PRNGKey(7), 0.7, (32,))

    def ours(c, mask, delta):
        y = masked_linear(c, {"s": SiteMask(mask, delta, routed)})("s", x, W)
        return jnp.sum(jnp.sin(y))

    def written(c, mask, delta):
        V, U = c.sites["s"].V, c.sites["s"].U
        y = (x @ V * mask) @ U + (x @ (W - V @ U)) * delta[:, None]
        return jnp.sum(jnp.sin(jnp.where(routed[:, None], y, x @ W)))

    got = jax.value_and_grad(ours, argnums=(0, 1, 2))(comps, mask, delta)
    want = jax.value_and_grad(written, argnums=(0, 1, 2))(comps, mask, delta)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_narrow_dot_and_einsum_gradients():
    """`dot` with bfloat16 operands of float32 inputs: float32 results forward and backward,
    within bfloat16's rounding of the float32 matmul's value and gradients; `einsum` the
    same; with no operand dtype, exactly x @ w."""
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 64))
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 32))

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    for narrow, full in ((lambda x, w: dot(x, w, jnp.bfloat16), lambda x, w: x @ w),
                         (lambda x, w: einsum("btk,kn->btn", x, w, "bfloat16"),
                          lambda x, w: jnp.einsum("btk,kn->btn", x, w))):
        got = jax.value_and_grad(loss(narrow), argnums=(0, 1))(x, w)
        want = jax.value_and_grad(loss(full), argnums=(0, 1))(x, w)
        for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.dtype == jnp.float32
            np.testing.assert_allclose(g, v, rtol=0.1, atol=0.1 * float(jnp.abs(v).mean()))
    np.testing.assert_array_equal(dot(x, w), x @ w)


def test_uniform_k_routes_between_one_and_all_live_sites():
    live = [f"s{i}" for i in range(4)]
    r = sample_routing(jax.random.PRNGKey(0), "uniform_k", live, (4000,))
    counts = np.stack([np.asarray(r[s]) for s in live], -1).sum(-1)
    assert counts.min() == 1 and counts.max() == 4
    # k ~ U{1..4}: each count about a quarter of positions
    np.testing.assert_allclose(np.bincount(counts)[1:] / 4000, 0.25, atol=0.03)
    assert all(v is None for v in sample_routing(jax.random.PRNGKey(0), "all", live, (5,))
               .values())


class _Weights:
    """A target reduced to its site weights (what faithfulness reads)."""

    def __init__(self, weights):
        self.weights = weights

    def site_weights(self):
        return self.weights


def test_faithfulness_is_fp32_even_for_bf16_weights():
    comps = Components.init(jax.random.PRNGKey(1), {"s": (8, 8)}, {"s": 3})
    W = jax.random.normal(jax.random.PRNGKey(2), (8, 8)).astype(jnp.bfloat16)
    f, _ = faithfulness({}, _Weights({"s": W}), comps, jax.tree.map(jnp.zeros_like, comps), 1.0)
    assert f.dtype == jnp.float32
    ref = np.mean((np.asarray(W, np.float32) - np.asarray(comps.sites["s"].weight)) ** 2)
    np.testing.assert_allclose(f, ref, rtol=1e-6)


def test_faithfulness_is_normalised_by_total_numel():
    comps = Components.init(jax.random.PRNGKey(0), {"a": (2, 2), "b": (4, 4)}, {"a": 1, "b": 1})
    zero = jax.tree.map(jnp.zeros_like, comps)  # V@U = 0, so ‖W‖² counts whole
    W = {"a": jnp.ones((2, 2)), "b": 2 * jnp.ones((4, 4))}
    np.testing.assert_allclose(faithfulness({}, _Weights(W), zero, zero, 1.0)[0],
                               (4 * 1 + 16 * 4) / (4 + 16))


@pytest.mark.parametrize("tie_update", ["shared", "per_site"])
def test_faithfulness_gradient_is_autodiffs_of_its_definition_added_in_place(tie_update):
    """Sites of one kind stacked over three layers, a tied pair: the step's faithfulness
    (its gradient written into the microbatches' by hand, member by member) against autodiff
    of Σ ‖W − V@U‖² / Σ numel(W) over every site, followers as their leaders' transposes."""
    shapes = {"layers.0.w": (5, 3), "layers.1.w": (5, 3), "layers.2.w": (5, 3),
              "linear1": (4, 6), "linear2": (6, 4)}
    C = {s: 2 for s in shapes}
    tied = {"linear2": "linear1"}
    layout = reduce(Groups.without, tied, Groups.of(tuple(shapes), alone=("linear1", "linear2")))
    comps = Components.init(jax.random.PRNGKey(0), shapes, C, layout)
    assert comps.groups["layers.*.w"].V.shape == (3, 5, 2)
    W = {s: jax.random.normal(jax.random.PRNGKey(i + 1), sh) for i, (s, sh) in
         enumerate(shapes.items())}
    stepped = with_tied(comps, tied) if tie_update == "per_site" else comps
    acc = jax.tree.map(lambda x: jnp.full_like(x, 0.5), stepped)

    def definition(c):
        sites = with_tied(c, tied).sites
        return sum(jnp.sum((W[s] - v.V @ v.U) ** 2) for s, v in sites.items()) / sum(
            W[s].size for s in sites)

    f, got = faithfulness(tied, _Weights(W), stepped, acc, 3.0)
    want_f, want_g = jax.value_and_grad(definition)(stepped)
    np.testing.assert_allclose(f, want_f, rtol=1e-6)
    for g, w, a in zip(jax.tree.leaves(got), jax.tree.leaves(want_g), jax.tree.leaves(acc),
                       strict=True):
        np.testing.assert_allclose(g, a + 3.0 * w, rtol=1e-5, atol=1e-6)


def test_p_anneals_linearly_inside_its_window():
    p = [float(losses.p_at(s, 100, 2.0, 0.4, 0.2, 0.6)) for s in (0, 20, 40, 60, 100)]
    np.testing.assert_allclose(p, [2.0, 2.0, 1.2, 0.4, 0.4], rtol=1e-6)


def test_a_flat_p_is_a_constant_the_compiler_folds_into_the_power():
    def penalty(ci, step):
        return losses.PENALTIES["lp"](ci, losses.p_at(step, 100, 2.0, 2.0, 0.0, 1.0), 0.0)

    ci = jnp.linspace(0.0, 1.0, 8)
    np.testing.assert_allclose(jax.jit(penalty)(ci, 7), ci**2, rtol=1e-6)
    hlo = jax.jit(penalty).lower(ci, 7).compile().as_text()
    assert " power(" not in hlo  # a runtime exponent of 2 + 0 * t is a power kernel's cost


def test_imp_min_matches_its_definition():
    ci = jax.random.uniform(jax.random.PRNGKey(0), (3, 4, 5))
    p, eps, beta = 0.7, 1e-6, 0.2
    S = np.sum((np.asarray(ci) + eps) ** p, axis=(0, 1))
    expected = np.sum(S / 12 * (1 + beta * np.log2(1 + S)))
    np.testing.assert_allclose(losses.importance_minimality({"s": ci}, p, eps, beta), expected,
                               rtol=1e-5)


def test_smooth_l0_is_geman_mcclure_flat_at_zero_and_of_bounded_gradient():
    ci = jnp.array([0.0, 0.05, 0.1, 0.5, 1.0])
    gamma = 0.1
    psi = losses.PENALTIES["smooth_l0"]
    np.testing.assert_allclose(psi(ci, gamma, 0.0), ci**2 / (ci**2 + gamma**2), rtol=1e-6)
    grad = jax.vmap(jax.grad(lambda c: psi(c, gamma, 0.0)))(ci)
    assert float(grad[0]) == 0.0  # no cliff at 0, where Lp's p < 1 gradient is unbounded
    assert float(jnp.abs(grad).max()) <= 0.65 / gamma * 1.0001
    lp = jax.grad(lambda c: losses.PENALTIES["lp"](c, 0.4, 1e-12))(jnp.float32(1e-6))
    assert float(lp) > 1e2
    # the same aggregation as Lp: sums over positions, the log term on top
    ci3 = jax.random.uniform(jax.random.PRNGKey(0), (3, 4, 5))
    S = np.sum(np.asarray(ci3) ** 2 / (np.asarray(ci3) ** 2 + gamma**2), axis=(0, 1))
    np.testing.assert_allclose(
        losses.importance_minimality({"s": ci3}, gamma, 0.0, 0.5, penalty="smooth_l0"),
        np.sum(S / 12 * (1 + 0.5 * np.log2(1 + S))), rtol=1e-5)


@pytest.mark.parametrize("kind,k,n_sites,expected", [
    ("all", 0, 27, 1), ("layerwise", 0, 27, 27), ("chunkwise", 9, 27, 3),
    ("chunkwise", 3, 27, 9), ("chunkwise", 2, 5, 3), ("chunkwise", 5, 5, 1)])
def test_plan_forward_counts(kind, k, n_sites, expected):
    sites = [f"s{i}" for i in range(n_sites)]
    plan = make_plan(kind, sites, k)
    assert len(plan) == expected
    assert [s for fwd in plan for s in fwd] == sites  # every site once, in order


def test_recon_term_with_zero_coeff_is_off():
    from pdecomp.plan.resolve import resolve

    cfg = RunConfig()
    recon = {**cfg.loss.recon, "layerwise": dc.replace(cfg.loss.recon["layerwise"], coeff=0.0)}
    spec = resolve(dc.replace(cfg, loss=dc.replace(cfg.loss, recon=recon))).step
    assert [t.name for t in spec.method.terms] == ["recon_full"]


def test_tms_sites_in_canonical_order():
    t = _tms(hidden=1)
    assert isinstance(t, TMS) and list(t.site_weights()) == ["linear1", "hidden", "linear2"]


@pytest.mark.parametrize("d_in", [6, 200])  # V folded into each group, or x @ V once
def test_block_diagonal_ci_mlp_equals_elementwise_form(d_in):
    from pdecomp.spd import ci as ci_mod
    from pdecomp.spd.ci import ComponentwiseMLP

    C = 2 * ci_mod._BLOCK_DIAG_GROUP + 3  # two whole groups and a short one
    net = ComponentwiseMLP.init(jax.random.PRNGKey(0), C, d_in, [16], on_inner_acts=True)
    net = jax.tree.map(lambda w: w + 0.1, net)  # nonzero biases too
    V = jax.random.normal(jax.random.PRNGKey(1), (d_in, C)) / np.sqrt(d_in)
    x = jax.random.normal(jax.random.PRNGKey(2), (32, d_in))
    cot = jax.random.normal(jax.random.PRNGKey(3), (32, C))

    def value_and_grads():
        return jax.value_and_grad(lambda n, V: jnp.sum(n(x, V) * cot), argnums=(0, 1))(net, V)

    fast, fast_grads = value_and_grads()
    old, ci_mod._BLOCK_DIAG_MAX_C = ci_mod._BLOCK_DIAG_MAX_C, 0
    try:
        slow, slow_grads = value_and_grads()
    finally:
        ci_mod._BLOCK_DIAG_MAX_C = old
    np.testing.assert_allclose(fast, slow, rtol=1e-5)
    for f, s in zip(jax.tree.leaves(fast_grads), jax.tree.leaves(slow_grads), strict=True):
        np.testing.assert_allclose(f, s, rtol=1e-4, atol=1e-5)


def test_block_diagonal_ci_mlp_only_where_the_step_is_lowered_for_cpu():
    from pdecomp.spd.ci import _BLOCK_DIAG_GROUP, ComponentwiseMLP

    net = ComponentwiseMLP.init(jax.random.PRNGKey(0), 20, 6, [16], on_inner_acts=True)
    traced = jax.jit(lambda n, x, V: n(x, V)).trace(net, jnp.ones((32, 6)), jnp.ones((6, 20)))
    group_matmul = f"tensor<32x{_BLOCK_DIAG_GROUP * 16}xf32>"  # a group's hidden layer
    assert group_matmul in traced.lower(lowering_platforms=("cpu",)).as_text()
    # a deviceless GPU gate lowers on a CPU host: it must get the GPU's (elementwise) form
    assert group_matmul not in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("hidden", [[8], [8, 4], []])
def test_vector_mlp_contracts_the_shared_input_without_a_per_component_copy(hidden):
    """`vector_mlp` feeds every component the whole site input: its first layer is one
    contraction of that input with all C components' weights. The same numbers (values and
    gradients, 1e-6) as the formulation that broadcast the input to every component first,
    and no [*pos, C, d_in] buffer anywhere in the step's program."""
    from pdecomp.spd.ci import ComponentwiseMLP

    C, d_in, n = 24, 40, 32
    net = ComponentwiseMLP.init(jax.random.PRNGKey(0), C, d_in, hidden, on_inner_acts=False)
    net = jax.tree.map(lambda w: w + 0.1, net)
    x = jax.random.normal(jax.random.PRNGKey(2), (n, d_in))
    V = jnp.zeros((d_in, C))  # unread by vector_mlp
    cot = jax.random.normal(jax.random.PRNGKey(3), (n, C))

    def broadcast_form(net, x):  # the earlier formulation, written out
        h = jnp.broadcast_to(x[:, None, :], (n, C, d_in))
        for i, (w, b) in enumerate(zip(net.weights, net.biases)):
            h = jnp.einsum("nci,cio->nco", jax.nn.gelu(h) if i else h, w) + b
        return h[..., 0]

    def loss(f):
        return lambda net, x: jnp.sum(f(net, x) * cot)

    with jax.default_matmul_precision("highest"):
        new, new_g = jax.value_and_grad(loss(lambda m, x: m(x, V)), argnums=(0, 1))(net, x)
        old, old_g = jax.value_and_grad(loss(broadcast_form), argnums=(0, 1))(net, x)
    np.testing.assert_allclose(new, old, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(new_g), jax.tree.leaves(old_g), strict=True):
        # float32 sums in another order: 1e-6 of the largest entry, not of each near-zero one
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))
    step = jax.jit(jax.grad(loss(lambda m, x: m(x, V)), argnums=(0, 1)))
    hlo = step.lower(net, x).compile().as_text()
    assert f"f32[{n},{C},{d_in}]" not in hlo and f"f32[{C},{n},{d_in}]" not in hlo


def test_ci_mlp_init_he_into_gelu_and_unit_gain_at_the_linear_output():
    from pdecomp.spd.ci import ComponentwiseMLP, SharedMLP

    H = 16
    per_comp = ComponentwiseMLP.init(jax.random.PRNGKey(0), 4000, 1, [H, H], on_inner_acts=True)
    shared = SharedMLP.init(jax.random.PRNGKey(1), 4000, 64, [H])
    expected = [(per_comp.weights, [np.sqrt(2.0), np.sqrt(2.0 / H), np.sqrt(1.0 / H)]),
                (shared.weights, [np.sqrt(2.0 / 64), np.sqrt(1.0 / H)])]
    for weights, stds in expected:
        for w, std in zip(weights, stds, strict=True):
            assert float(jnp.std(w)) == pytest.approx(std, rel=0.03)


def test_tied_follower_is_the_leaders_transpose_and_trains_it():
    from pdecomp.spd.components import with_tied

    lead = Components.init(jax.random.PRNGKey(1), {"linear1": (5, 2)}, {"linear1": 4})
    both = with_tied(lead, {"linear2": "linear1"})
    np.testing.assert_array_equal(both.sites["linear2"].V, lead.sites["linear1"].U.T)
    np.testing.assert_array_equal(both.sites["linear2"].U, lead.sites["linear1"].V.T)
    target = _tms()
    x = jax.random.uniform(jax.random.PRNGKey(2), (16, 5))

    def loss(c):  # only linear2 is live: its gradient must reach linear1's parameters
        masks = {"linear2": SiteMask(jnp.full((16, 4), 0.5), None, None)}
        return jnp.sum(target(x, masked_linear(with_tied(c, {"linear2": "linear1"}), masks)))

    g = jax.grad(loss)(lead)
    assert float(jnp.abs(g.sites["linear1"].V).max()) > 0.0


@pytest.mark.parametrize("tie_update", ["shared", "per_site"])
def test_tied_update_shared_sums_gradients_per_site_steps_each_site(tie_update):
    from pdecomp.plan.resolve import resolve
    from pdecomp.spd.step import apply_component_updates, optimized_components, optimizer

    cfg = RunConfig()
    cfg = dc.replace(cfg, layers=dc.replace(cfg.layers, tie_update=tie_update))
    lead = Components.init(jax.random.PRNGKey(1), {"linear1": (5, 2)}, {"linear1": 4})
    spec = resolve(cfg).step
    stepped = optimized_components(spec, lead)
    assert set(stepped.sites) == ({"linear1", "linear2"} if tie_update == "per_site"
                                  else {"linear1"})
    k = jax.random.split(jax.random.PRNGKey(2), 4)
    g1 = SiteComponents(jax.random.normal(k[0], (5, 4)), jax.random.normal(k[1], (4, 2)))
    g2 = SiteComponents(jax.random.normal(k[2], (2, 4)), jax.random.normal(k[3], (4, 5)))
    grads = Components.of_sites({"linear1": g1, "linear2": g2}) if tie_update == "per_site" else \
        Components.of_sites({"linear1": SiteComponents(g1.V + g2.U.T, g1.U + g2.V.T)})  # autodiff's sum
    opt = optimizer(cfg.optim.components, cfg.optim.steps)
    updates, _ = opt.update(grads, opt.init(stepped), stepped)
    new = apply_component_updates(spec, lead, updates).sites["linear1"]

    lr, old = cfg.optim.components.lr, lead.sites["linear1"]
    # A first Adam step from zero moments is lr * g / (|g| + eps): about lr * sign(g).
    if tie_update == "per_site":  # one step per site, both on the shared parameters
        want_V = old.V - lr * (jnp.sign(g1.V) + jnp.sign(g2.U.T))
        want_U = old.U - lr * (jnp.sign(g1.U) + jnp.sign(g2.V.T))
    else:
        want_V = old.V - lr * jnp.sign(g1.V + g2.U.T)
        want_U = old.U - lr * jnp.sign(g1.U + g2.V.T)
    np.testing.assert_allclose(new.V, want_V, atol=1e-6)
    np.testing.assert_allclose(new.U, want_U, atol=1e-6)


def test_train_step_takes_the_tied_update_it_is_configured_with():
    from pdecomp.kinds import cache as targets
    from pdecomp.kinds import toy as toys
    from pdecomp.plan.resolve import resolve
    from pdecomp.spd.step import init_state, make_train_step

    base = dc.replace(RunConfig(), data=dc.replace(RunConfig().data, batch_size=64))
    target = targets.init_target(jax.random.PRNGKey(0), base.model)
    x = toys.sample_inputs(jax.random.PRNGKey(2), base.model, 64)
    leaders = {}
    for mode in ("shared", "per_site"):
        cfg = dc.replace(base, layers=dc.replace(base.layers, tie_update=mode))
        spec = resolve(cfg).step
        state = init_state(jax.random.PRNGKey(1), spec, target)
        new, metrics = jax.jit(make_train_step(spec))(state, target, x)
        assert set(new.components.sites) == {"linear1"}  # the follower still owns nothing
        # per-site keeps AdamW moments for the follower's use of the shared parameters
        moments = optax.tree_utils.tree_get(new.comp_opt, "mu")
        assert set(moments.sites) == ({"linear1", "linear2"} if mode == "per_site"
                                      else {"linear1"})
        assert np.isfinite(float(metrics["loss/total"]))
        leaders[mode] = new.components.sites["linear1"].V
    # the same state, batch and key, two different steps on the shared parameters
    assert float(jnp.abs(leaders["shared"] - leaders["per_site"]).max()) > 1e-4


def test_train_step_takes_its_optimizers_as_arguments():
    from pdecomp.kinds import cache as targets
    from pdecomp.kinds import toy as toys
    from pdecomp.plan.resolve import resolve
    from pdecomp.spd.step import Optimizers, init_state, make_train_step

    cfg = dc.replace(RunConfig(), data=dc.replace(RunConfig().data, batch_size=64))
    target = targets.init_target(jax.random.PRNGKey(0), cfg.model)
    x = toys.sample_inputs(jax.random.PRNGKey(2), cfg.model, 64)

    def one_step(optimizers):
        spec = resolve(cfg).step
        state = init_state(jax.random.PRNGKey(1), spec, target, optimizers)
        return state, jax.jit(make_train_step(spec, optimizers=optimizers))(state, target, x)[0]

    # the config's own, given explicitly, are the default
    _, default = one_step(None)
    _, explicit = one_step(Optimizers.of(cfg.optim))
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(
        jax.tree.leaves(default), jax.tree.leaves(explicit), strict=True))
    # others are used: SGD with zero learning rate leaves components and CI function as
    # they were, while the default AdamW moves them
    before, frozen = one_step(Optimizers(optax.sgd(0.0), optax.sgd(0.0)))
    for part in ("components", "ci_fn"):
        pairs = list(zip(jax.tree.leaves(getattr(before, part)),
                         jax.tree.leaves(getattr(frozen, part)),
                         jax.tree.leaves(getattr(default, part)), strict=True))
        assert all(bool(jnp.array_equal(b, f)) for b, f, _ in pairs)
        assert any(not bool(jnp.array_equal(b, d)) for b, _, d in pairs)
    assert int(frozen.step) == 1


@pytest.mark.parametrize("ci_fn", ["mlp", "vector_mlp", "shared_mlp"])
@pytest.mark.parametrize("source,routing,plan", [
    ("continuous", "all", "all"), ("binomial", "uniform_k", "chunkwise"),
    ("ci", "all", "layerwise")])
def test_every_ci_fn_source_routing_and_plan_trains(ci_fn, source, routing, plan):
    from pdecomp.core.config import ReconTermConfig
    from pdecomp.plan.resolve import resolve
    from pdecomp.spd.step import init_state, make_train_step

    base = RunConfig()
    term = ReconTermConfig(plan=plan, sites_per_chunk=1, source=source, routing=routing)
    cfg = dc.replace(base, layers=dc.replace(base.layers, ci_fn=ci_fn, ci_hidden=[8, 4],
                                             tie=False),
                     loss=dc.replace(base.loss, recon={"t": term}))
    target = _tms(hidden=0)
    spec = resolve(cfg).step
    state = init_state(jax.random.PRNGKey(0), spec, target)
    x = jax.random.uniform(jax.random.PRNGKey(1), (64, 5))
    step = jax.jit(make_train_step(spec))
    new, m = step(state, target, x)
    assert np.isfinite(float(m["loss/total"])) and float(m["loss/recon_t"]) >= 0
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new.ci_fn, state.ci_fn)
    assert max(jax.tree.leaves(moved)) > 0  # the CI function receives gradient

"""Counts past 2^31: the decomposed matrices of 13 or more of Llama-3.1-8B's MLP layers
hold more than 2^31 elements, which a traced computation cannot take as an int32 constant.
Abstract shapes only: nothing is allocated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launcher.api import compose
from pdecomp.gate.shapes import abstract_run
from pdecomp.plan.resolve import resolve
from pdecomp.spd import losses
from pdecomp.spd.components import Components, Groups
from pdecomp.spd.step import faithfulness, make_train_step

D, F = 4096, 14336  # Llama-3.1-8B's d_embed and d_mlp


class _Stacks:
    def __init__(self, stacks):
        self.stacks = stacks

    def weight_stacks(self, layout):
        return self.stacks


def eight_b_mlps(layers: range) -> dict[str, jax.ShapeDtypeStruct]:
    return {f"layers.{i}.mlp.{w}": jax.ShapeDtypeStruct((F, D) if w == "down_proj" else (D, F),
                                                        jnp.bfloat16)
            for i in layers for w in ("gate_proj", "up_proj", "down_proj")}


def test_faithfulness_normaliser_past_2_31_is_exact():
    deltas = eight_b_mlps(range(32))  # the 96 sites of issue #33: 5,637,144,576 elements
    total = sum(int(np.prod(d.shape)) for d in deltas.values())
    assert total == 5_637_144_576 > 2 ** 31
    layout = Groups.of(tuple(deltas))
    comps = jax.eval_shape(lambda: Components.init(
        jax.random.PRNGKey(0), {s: d.shape for s, d in deltas.items()}, dict.fromkeys(deltas, 8),
        layout))
    stacks = {g: (jax.ShapeDtypeStruct((32, *deltas[ss[0]].shape), jnp.bfloat16),
                  jax.ShapeDtypeStruct((32,), jnp.int32)) for g, ss in layout.members}
    out, _ = jax.eval_shape(lambda st, c: faithfulness({}, _Stacks(st), c, c, 1.0), stacks,
                            comps)  # raised OverflowError while tracing
    assert out.shape == () and out.dtype == jnp.float32
    # The normaliser against exact arithmetic: f32(1 / total) to its last bit.
    assert np.float32(losses.per(total)) == np.float32(1 / total)


def test_importance_over_more_than_2_31_positions():
    ci = {"s": jax.ShapeDtypeStruct((2 ** 16, 2 ** 15 + 1, 1), jnp.float32)}  # 2^31 + 2^16
    out = jax.eval_shape(lambda c: losses.importance_minimality(c, 2.0, 1e-6, 0.2), ci)
    assert out.shape == ()
    S = {"s": jnp.full((3,), 2.0 ** 33, jnp.float32)}
    n = 2 ** 33  # m_c = S_c / n = 1 exactly
    want = 3 * (1 + 0.2 * np.log2(1 + 2.0 ** 33))
    assert float(losses.importance_from_sums(S, n, 0.2)) == pytest.approx(want, rel=1e-6)


def test_the_8b_step_traces_with_13_mlp_layers():
    """The step of the 8B preset, sites of layers 14-26 (39 sites, 2.29e9 elements), traced
    to its output shapes: the whole loss, not only the faithfulness term."""
    sites = ",".join(f"layers.{i}.mlp.{w}" for i in range(14, 27)
                     for w in ("gate_proj", "up_proj", "down_proj"))
    cfg = compose(["+experiment=llama8b_l18-26_chunkwise", f"layers.sites=[{sites}]",
                   "loss.recon.chunkwise.sites_per_chunk=13", "data.batch_size=16",
                   "optim.microbatch_size=0", "mesh=single", "data.source=synthetic"])
    target, state = abstract_run(resolve(cfg), jax.random.PRNGKey(0))
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len), jnp.int32)
    spec = resolve(cfg).step
    new_state, metrics = jax.eval_shape(make_train_step(spec), state, target, batch)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert metrics["loss/faithfulness"].shape == ()


def _step_equations(first: int, per_chunk: int) -> int:
    """The equations of the whole-8B preset's step over the sites of layers first..31 (in
    chunks of `per_chunk`), traced on shapes, counting every nested program's once."""
    cfg = compose(["+experiment=llama8b_all",
                   f"layers.sites=[layers.{first}-31.self_attn,layers.{first}-31.mlp]",
                   f"loss.recon.chunkwise.sites_per_chunk={per_chunk}", "data.batch_size=8",
                   "data.seq_len=64", "optim.microbatch_size=0", "mesh=single",
                   "data.source=synthetic"])
    run = resolve(cfg)
    target, state = abstract_run(run, jax.random.PRNGKey(0))
    batch = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len), jnp.int32)
    jaxpr = jax.make_jaxpr(make_train_step(run.step))(state, target, batch)

    def count(j) -> int:
        n = 0
        for e in j.eqns:
            n += 1
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    n += count(inner) if hasattr(inner, "eqns") else 0
        return n

    return count(jaxpr.jaxpr)


def test_the_step_does_not_grow_with_the_layers():
    """The whole 8B's step (every matrix of each layer, C per kind) over the last 4 and the
    last 12 layers' sites (28 and 84), in two chunks each: the same program, equation for
    equation. Each kind's
    sites are one group, so their CI heads, masks, losses and optimizer moments are traced
    once per kind, and a chunk's layers run under one scanned layer: what keeps the 224-site
    gate's compile in minutes."""
    assert _step_equations(28, 14) == _step_equations(20, 42)

"""A reader's share of a checkpoint written before the state was stacked by group
(pdecomp/run/older_layout.py): components per site and the global CI transformer's per-site
input rows and logit heads, restacked into this version's layout."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest

from pdecomp.run.checkpoint import Checkpointer
from pdecomp.run.older_layout import restack, stored_fields
from pdecomp.spd.ci import CIFunction
from pdecomp.spd.ci_global import GlobalCITransformer
from pdecomp.spd.components import Components

# two layers of one kind (a group of two) and a site of another shape and C
SHAPES = {"layers.0.mlp.up_proj": (6, 10), "layers.0.mlp.down_proj": (10, 6),
          "layers.1.mlp.up_proj": (6, 10)}
C = {"layers.0.mlp.up_proj": 4, "layers.0.mlp.down_proj": 3, "layers.1.mlp.up_proj": 4}


def as_older(components: Components, ci_fn: CIFunction) -> dict:
    """The same arrays as the layout before the stacking kept them: V, U per site; the
    input projection's rows concatenated in the network's site order; a head per site."""
    net = ci_fn.global_net
    shared = {f.name: getattr(net, f.name) for f in dataclasses.fields(net)
              if eqx.is_array(getattr(net, f.name)) and f.name not in ("w_in", "w_out", "b_out")}
    return {"components": {"sites": {s: {"V": c.V, "U": c.U}
                                     for s, c in components.sites.items()}},
            "ci_fn": {"global_net": {**shared, **net.per_site()}}}


@pytest.fixture(scope="module")
def state() -> tuple[Components, CIFunction]:
    components = Components.init(jax.random.key(0), SHAPES, C)
    net = GlobalCITransformer.init(jax.random.key(1), {s: d for s, (d, _) in SHAPES.items()},
                                   C, d_model=8, n_blocks=1, n_heads=2, d_mlp=16,
                                   layout=components.layout)
    return components, CIFunction(sites={}, global_net=net)


def test_an_older_checkpoint_is_restacked_as_this_version_stacks_it(state, tmp_path) -> None:
    components, ci_fn = state
    assert len(components.layout.of_group("layers.*.mlp.up_proj")) == 2
    ckpt = Checkpointer(tmp_path / "checkpoints")
    ckpt.save(7, as_older(components, ci_fn))  # what the older version wrote
    ckpt.wait()
    stored = stored_fields(ckpt.item_dir(7))
    ckpt.close()
    fields = {"components": components, "ci_fn": ci_fn}
    got = restack(stored, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       fields))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fields),
                            jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))


def test_an_older_checkpoint_of_other_settings_names_the_leaf(state) -> None:
    components, ci_fn = state
    older = jax.tree.map(np.asarray, as_older(components, ci_fn))
    older["components"]["sites"]["layers.1.mlp.up_proj"]["V"] = np.zeros((6, 5), np.float32)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            {"components": components})
    with pytest.raises(ValueError, match=r"components.*groups.*up_proj.*V: stored "
                                         r"\[\(6, 4\), \(6, 5\)\], expected \[\(6, 4\), \(6, 4\)\]"):
        restack(older, abstract)
    del older["components"]["sites"]["layers.0.mlp.down_proj"]
    with pytest.raises(ValueError, match="down_proj.*not in the checkpoint"):
        restack(older, abstract)

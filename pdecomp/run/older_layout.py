"""Reading a checkpoint written before the state was stacked by group (components per site):
a reader's share of it (the components and the CI function) restacked into this version's
layout, so a finished run stays readable by `analyze`, `export` and the API.

What changed, and so what is restacked (everything else is read where it lies):
- `components.sites[s].{V, U}` per site -> `components.groups[g].{V, U}`, the group's
  members stacked on a leading axis;
- the global CI transformer's input projection `w_in [Σ d_in, d_model]` (every site's rows,
  in the network's site order) -> `w_in[g] [n, d_in, d_model]`, and its logit heads, a
  tuple per site (`w_out[i] [d_model, C]`, `b_out[i] [C]`) -> `w_out[g]`, `b_out[g]`: the
  inverse of `GlobalCITransformer.per_site`.
A run's optimizer moments and adversary are not converted: resuming such a run takes the
pdecomp that wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from pdecomp.run.checkpoint import key_of

READ = ("components", "ci_fn")


def stored_fields(item_dir: Path, fields: tuple[str, ...] = READ) -> dict[str, Any]:
    """The named top-level fields of a checkpoint's item, as the nested dicts and lists it
    stores, read into host memory (nothing else is read)."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        meta = handler.metadata(item_dir)
        meta = getattr(meta, "tree", meta)
        item = {f: meta[f] for f in fields if f in meta}
        return handler.restore(item_dir, args=ocp.args.PyTreeRestore(
            item=item, partial_restore=True, restore_args=jax.tree.map(
                lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)))
    finally:
        handler.close()


def restack(stored: dict[str, Any], abstract: dict[str, Any]) -> dict[str, Any]:
    """`abstract`'s fields ({"components": ..., "ci_fn": ...}, this version's abstract
    trees with their shardings) filled from `stored` (an older checkpoint's fields, as
    `stored_fields` reads them) and placed. ValueError, naming the leaf, where a stored
    array is missing or of another shape."""
    out = {}
    for name, tree in abstract.items():
        def leaf(kp, x, name=name, tree=tree):
            keys = [key_of(k) for k in kp]
            try:
                value = _older(stored[name], keys, tree)
            except (KeyError, IndexError) as e:
                raise ValueError(f"{name}{jax.tree_util.keystr(kp)}: not in the checkpoint "
                                 f"({e})") from None
            shapes = [v.shape for v in value] if isinstance(value, list) else value.shape
            want = [tuple(x.shape[1:])] * x.shape[0] if isinstance(value, list) else x.shape
            if shapes != want:
                raise ValueError(f"{name}{jax.tree_util.keystr(kp)}: stored {shapes}, "
                                 f"expected {want}")
            value = (np.stack(value) if isinstance(value, list) else value).astype(x.dtype)
            if x.sharding is None:
                return jax.device_put(value)
            # each process places only its own devices' slices (a reader on many hosts)
            return jax.make_array_from_callback(value.shape, x.sharding, lambda ix: value[ix])

        out[name] = jax.tree_util.tree_map_with_path(leaf, tree)
    return out


def _older(stored: Any, keys: list, tree: Any) -> np.ndarray | list[np.ndarray]:
    """One leaf of this version's tree (its key path `keys` under `tree`) from the older
    layout's arrays: a stacked leaf as its members' arrays, to be checked and stacked."""
    if keys[:1] == ["groups"]:  # components: each member site's own
        g, part = keys[1], keys[2]
        return [np.asarray(stored["sites"][s][part]) for s in tree.layout.of_group(g)]
    if keys[:1] == ["global_net"] and keys[1] in ("w_in", "w_out", "b_out"):
        net, old = tree.global_net, stored["global_net"][keys[1]]
        ix = [net.sites.index(s) for s in net.layout.of_group(keys[2])]
        if keys[1] != "w_in":  # a tuple of heads, one per site in the network's order
            return [np.asarray(old[i]) for i in ix]
        start = np.cumsum([0, *net.d_in])
        return [np.asarray(old[start[i]:start[i + 1]]) for i in ix]
    for k in keys:
        stored = stored[k]
    return np.asarray(stored)

"""Meshes and shardings: a `data` axis and a `model` axis. The batch splits on `data`;
components split on `model` along C (logical axis `comp`), so a site's V, U, CI logit head,
logits, masks and inner activations are never whole on one device; with `shard_state`
(FSDP) every leaf also splits its largest remaining dimension on `data` (with
`shard_weights` false, only the optimizer moments and the adversary: ZeRO-1).

Each array leaf has logical axis names (`logical_axes`); the mesh config's `rules` map them
to mesh axes. Everything here works on abstract trees (ShapeDtypeStructs), so the same
shardings serve the gate's compile, the state's initialisation into place, and checkpoint
restore.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from pdecomp.core import hardware
from pdecomp.core.config import ConfigError, GateConfig, MeshConfig

AXIS = "data"
MODEL = "model"

# Logical axis names of a leaf's dimensions, by the end of its path in the state or target
# (optimizer moments end like the parameter they follow, so they get its names). The
# adversary's sources are [1|B, (1|T,) C+1]: the delta channel makes their last dimension
# indivisible, so they split on `data` only.
LOGICAL: tuple[tuple[str, tuple[str, ...]], ...] = (
    # a group's components and CI heads, stacked over its members (the leading axis)
    (r"\.V$", (None, "embed", "comp")),
    (r"\.U$", (None, "comp", "embed")),
    (r"\.w_out\['[^']*'\]$", (None, "ci_embed", "comp")),
    (r"\.b_out\['[^']*'\]$", (None, "comp")),
    # the global CI transformer's input projection (every site's inputs in: each site's rows,
    # stacked by group)
    (r"\.w_in\['[^']*'\]$", (None, "ci_in", "ci_embed")),
)


def logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """The logical names of a leaf's dimensions (None: unnamed)."""
    for pattern, names in LOGICAL:
        if re.search(pattern, path) and len(names) == ndim:
            return names
    return (None,) * ndim


@dataclass(frozen=True)
class Layout:
    """A mesh and the rules that map logical axis names onto its axes."""

    mesh: Mesh
    rules: Mapping[str, str | None]
    fsdp: bool = False  # split each leaf's largest unnamed dimension on `data` too
    fsdp_weights: bool = True  # ... the weights' too, not only the STATE_ONLY fields'

    def spec(self, names: Sequence[str | None], shape: tuple[int, ...], fsdp: bool = True
             ) -> P:
        """Mesh axes for `shape`: a named dimension takes its rule's axis where the axis has
        more than one device and divides it; with FSDP the largest dimension left then
        takes `data` where it divides (`fsdp` false: not for this leaf). (A leaf with no C
        dimension, such as the frozen target, is then repeated on each device of the model axis: splitting it over both
        axes halved the 8B preset's argument bytes but made XLA's partitioner replicate
        the weight deltas between layouts and doubled the compile.)"""
        axes: list[Any] = [None] * len(shape)
        for i, name in enumerate(names):
            ax = self.rules.get(name) if name else None
            if ax in self.mesh.shape and ax not in axes and self.mesh.shape[ax] > 1 \
                    and shape[i] % self.mesh.shape[ax] == 0:
                axes[i] = ax
        n = self.mesh.shape.get(AXIS, 1)
        if fsdp and self.fsdp and n > 1 and AXIS not in axes:
            for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
                if axes[i] is None and shape[i] % n == 0:
                    axes[i] = AXIS
                    break
        return P(*axes)

    def constrain(self, x: Array, names: Sequence[str | None]) -> Array:
        """Pin an intermediate's layout (names for its dimensions, in order)."""
        if self.mesh.size == 1:
            return x
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, self.spec(names, x.shape)))

    def constrain_positions(self, x: Array) -> Array:
        """A [*pos, C] tensor: its first position axis on `data`, C on `model`."""
        return self.constrain(x, ("batch", *(None,) * (x.ndim - 2), "comp"))

    def constrain_members(self, x: Array) -> Array:
        """A group's [n, *pos, C], stacked over its members: as `constrain_positions`."""
        return self.constrain(x, (None, "batch", *(None,) * (x.ndim - 3), "comp"))


def make_layout(planned: MeshConfig, mesh: Mesh) -> Layout:
    """The layout the config's `mesh.rules` and `mesh.shard_state` ask for on `mesh`."""
    return Layout(mesh, dict(planned.rules), planned.shard_state, planned.shard_weights)


@dataclass(frozen=True)
class Placement:
    """Where a run's devices come from: the mesh asked for, the GPU a deviceless gate
    compiles for (`local`: this job's own devices), and the job's device count and data
    axis where known (None: not known, or deviceless)."""

    mesh: MeshConfig
    target: str
    deviceless: bool
    n_devices: int | None
    data_axis: int | None


def microbatch_counts(batch_size: int, axis: int) -> list[int]:
    """The microbatch counts a batch can be split into on a data axis of `axis` devices:
    each microbatch a whole number of examples on every device."""
    per_device = batch_size // axis
    return [m for m in range(1, per_device + 1) if per_device % m == 0]


def planned_gpus(me: MeshConfig) -> tuple[int, int]:
    """The GPUs a run is sized for: per host (`mesh.gpus_per_host`, 0 meaning one) and in all
    (`mesh.hosts` of them)."""
    per_host = max(me.gpus_per_host, 1)
    return per_host, me.hosts * per_host


def mesh_candidates(me: MeshConfig, microbatch: int) -> list[int]:
    """The model-axis sizes gate.fit=mesh compiles for the planned hosts x GPUs: those that
    divide a host's GPUs (the model axis's all-reduces stay within a host) and leave a data
    axis that splits a microbatch of `microbatch` examples into whole ones."""
    per_host, total = planned_gpus(me)
    return [m for m in range(1, per_host + 1)
            if per_host % m == 0 and microbatch % (total // m) == 0]


def is_deviceless(gate: GateConfig) -> bool:
    """A named GPU target on a host without GPUs: compile for it, run nothing."""
    return gate.target != "local" and jax.default_backend() != "gpu"


def check_target(gate: GateConfig) -> None:
    """A GPU this job does not have can be compiled for (given the compile plugin), not
    trained on."""
    if not is_deviceless(gate):
        return
    if not gate.only:
        raise ConfigError("gate.target", gate.target,
                          f"this job has no {gate.target}: add gate.only=true to gate for "
                          "it from here, or use gate.target=local to train")
    try:
        hardware.ensure_gpu_compile()
    except hardware.GpuCompileUnavailable as e:
        raise ConfigError("gate.target", gate.target, str(e)) from None


def make_mesh(placement: Placement) -> Mesh:
    """The run's data x model mesh (`mesh.model` devices on the model axis, the rest on data).

    Deviceless: `mesh.hosts x mesh.gpus_per_host` compile-only GPUs of the target. Local:
    the placement's data axis x `mesh.model` of this job's devices.
    """
    me = placement.mesh
    if placement.deviceless:  # preflight's check_target made the compile plugin available
        per_host, total = planned_gpus(me)
        return hardware.topology_mesh(placement.target, me.hosts, per_host,
                                      ((AXIS, total // me.model), (MODEL, me.model)))
    devices = jax.devices()
    assert placement.data_axis is not None, "a local mesh needs the job's devices resolved"
    n = me.model * placement.data_axis
    processes = {d.process_index for d in devices[:n]}
    if len(processes) < jax.process_count():  # a process with no device would have no work
        raise ConfigError("mesh.data", n, f"the mesh must take devices of all "
                          f"{jax.process_count()} processes of this job ({len(devices)} "
                          f"devices): make data.batch_size a multiple of {len(devices)}")
    return Mesh(np.array(devices[:n]).reshape(n // me.model, me.model), (AXIS, MODEL))


# The state's fields that `memory.offload_opt_state` keeps in host memory between steps.
OFFLOADED = ("comp_opt", "ci_opt")
HOST = "pinned_host"
DEVICE = "device"


# The state's fields FSDP splits over data whether or not it splits the weights
# (`mesh.shard_weights`): each device updates its slice of them and nothing gathers them.
STATE_ONLY = ("comp_opt", "ci_opt", "adversary")


def leaf_sharding(layout: Layout, path: str, shape: tuple[int, ...],
                  memory_kind: str | None = None) -> NamedSharding:
    field = re.match(r"\.?(\w*)", path).group(1)
    fsdp = layout.fsdp_weights or field in STATE_ONLY
    spec = layout.spec(logical_axes(path, len(shape)), shape, fsdp)
    return NamedSharding(layout.mesh, spec, memory_kind=memory_kind)


def place(tree: Any, layout: Layout, offload: Sequence[str] = ()) -> Any:
    """ShapeDtypeStructs of `tree`'s array leaves carrying their shardings; the leaves under
    the top-level fields named in `offload` live in pinned host memory."""

    def leaf(path, x):
        where = HOST if path and getattr(path[0], "name", None) in offload else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=leaf_sharding(
            layout, jax.tree_util.keystr(path), x.shape, where))

    return jax.tree_util.tree_map_with_path(leaf, tree)


def move(tree: Any, layout: Layout, memory_kind: str) -> Any:
    """Inside a jitted function: `tree`'s leaves copied to `memory_kind` (DEVICE or HOST),
    each keeping its sharding over the mesh."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, leaf_sharding(
            layout, jax.tree_util.keystr(path), x.shape, memory_kind)), tree)


def shardings(tree_abs: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree_abs)


def put_from_host(tree: Any, shardings_tree: Any) -> Any:
    """Arrays of `tree` (every process holds the same host copy) placed in their shardings.

    Each process fills only the shards of its own devices from its own copy. `device_put` of
    a host value onto devices of other processes would need the value sent between hosts,
    and on a multi-host mesh a gather-then-scatter of the frozen target would cost as much
    network traffic as the model is large, at every start.
    """

    def leaf(x, s):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

    return jax.tree.map(leaf, tree, shardings_tree)

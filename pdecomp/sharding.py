"""Meshes and shardings: a `data` axis and a `model` axis. The batch splits on `data`;
components split on `model` along C (logical axis `comp`), so a site's V, U, CI logit head,
logits, masks and inner activations are never whole on one device; with `shard_state`
(FSDP) every leaf also splits its largest remaining dimension on `data`.

Each array leaf has logical axis names (`logical_axes`); the mesh config's `rules` map them
to mesh axes. Everything here works on abstract trees (ShapeDtypeStructs), so the same
shardings serve the gate's compile, the state's initialisation into place, and checkpoint
restore.
"""

from __future__ import annotations

import dataclasses as dc
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from pdecomp import hardware
from pdecomp.config import ConfigError, GateConfig, MeshConfig, RunConfig

AXIS = "data"
MODEL = "model"

# Logical axis names of a leaf's dimensions, by the end of its path in the state or target
# (optimizer moments end like the parameter they follow, so they get its names). The
# adversary's sources are [1|B, (1|T,) C+1]: the delta channel makes their last dimension
# indivisible, so they split on `data` only.
LOGICAL: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"\.V$", ("embed", "comp")),
    (r"\.U$", ("comp", "embed")),
    (r"\.w_out\[\d+\]$", ("ci_embed", "comp")),
    (r"\.b_out\[\d+\]$", ("comp",)),
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

    def spec(self, names: Sequence[str | None], shape: tuple[int, ...]) -> P:
        """Mesh axes for `shape`: a named dimension takes its rule's axis where the axis has
        more than one device and divides it; with FSDP the largest dimension left then
        takes `data` where it divides. (A leaf with no C dimension, such as the frozen
        target, is then repeated on each device of the model axis: splitting it over both
        axes halved the 8B preset's argument bytes but made XLA's partitioner replicate
        the weight deltas between layouts and doubled the compile.)"""
        axes: list[Any] = [None] * len(shape)
        for i, name in enumerate(names):
            ax = self.rules.get(name) if name else None
            if ax in self.mesh.shape and ax not in axes and self.mesh.shape[ax] > 1 \
                    and shape[i] % self.mesh.shape[ax] == 0:
                axes[i] = ax
        n = self.mesh.shape.get(AXIS, 1)
        if self.fsdp and n > 1 and AXIS not in axes:
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


def make_layout(planned: MeshConfig, mesh: Mesh) -> Layout:
    """The layout the config's `mesh.rules` and `mesh.shard_state` ask for on `mesh`."""
    return Layout(mesh, dict(planned.rules), planned.shard_state)


def data_axis(cfg: RunConfig, n_devices: int | None) -> int | None:
    """The size of the mesh's data axis, where the config and the job's device count (None:
    not known here) settle it, by `make_mesh`'s rules: `mesh.data`; else the planned hosts x
    GPUs per host over the model axis (`mesh.gpus_per_host`, or a named GPU target before
    devices are known); else the most devices per model-axis group that split each
    microbatch into whole examples (`optim.microbatch_size` of them each, when set)."""
    me, o = cfg.mesh, cfg.optim
    if me.data:
        return me.data
    if me.gpus_per_host or (cfg.gate.target != "local" and n_devices is None):
        return me.hosts * max(me.gpus_per_host, 1) // me.model
    if n_devices is None:
        return None
    micro = cfg.data.batch_size // o.microbatches

    def splits(k: int) -> bool:
        return (cfg.data.batch_size % (o.microbatch_size * k) == 0 if o.microbatch_size
                else micro % k == 0)

    return max(k for k in range(1, n_devices // me.model + 1) if splits(k))


def with_microbatch_size(cfg: RunConfig, n_devices: int | None) -> RunConfig:
    """`optim.microbatch_size` turned into `optim.microbatches` for this mesh (the config
    unchanged without one, or where the data axis is not known yet)."""
    per = cfg.optim.microbatch_size
    if per <= 0 or cfg.optim.microbatches != 1:
        return cfg  # none asked for, or already settled (validate names a conflict)
    axis = data_axis(cfg, n_devices)
    if axis is None or cfg.data.batch_size % (per * axis):
        return cfg  # not known yet, or validate names what does not divide
    m = cfg.data.batch_size // (per * axis)
    return dc.replace(cfg, optim=dc.replace(cfg.optim, microbatches=m))


def microbatch_counts(batch_size: int, axis: int) -> list[int]:
    """The microbatch counts a batch can be split into on a data axis of `axis` devices:
    each microbatch a whole number of examples on every device."""
    per_device = batch_size // axis
    return [m for m in range(1, per_device + 1) if per_device % m == 0]


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


def make_mesh(cfg: RunConfig) -> Mesh:
    """The run's data x model mesh (`mesh.model` devices on the model axis, the rest on data).

    Deviceless: `mesh.hosts x mesh.gpus_per_host` compile-only GPUs of `gate.target`.
    Local: `mesh.data` x `mesh.model` devices, else the planned hosts x gpus_per_host when
    given, else the most devices that divide the batch (times the model axis).
    """
    me = cfg.mesh
    if is_deviceless(cfg.gate):  # preflight's check_target made the compile plugin available
        total = me.hosts * max(me.gpus_per_host, 1)
        return hardware.topology_mesh(cfg.gate.target, me.hosts, max(me.gpus_per_host, 1),
                                      ((AXIS, total // me.model), (MODEL, me.model)))
    devices = jax.devices()
    n = me.model * data_axis(cfg, len(devices))
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


def leaf_sharding(layout: Layout, path: str, shape: tuple[int, ...],
                  memory_kind: str | None = None) -> NamedSharding:
    spec = layout.spec(logical_axes(path, len(shape)), shape)
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

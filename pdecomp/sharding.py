"""Meshes and shardings: one data axis; the batch split on it, the state split too (FSDP)
or replicated.

Everything here works on abstract trees (ShapeDtypeStructs), so the same shardings serve the
gate's compile, the state's initialisation into place, and checkpoint restore.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdecomp import hardware
from pdecomp.config import ConfigError, RunConfig

AXIS = "data"


def is_deviceless(cfg: RunConfig) -> bool:
    """A named GPU target on a host without GPUs: compile for it, run nothing."""
    return cfg.gate.target != "local" and jax.default_backend() != "gpu"


def check_target(cfg: RunConfig) -> None:
    """A GPU this job does not have can be compiled for (given the compile plugin), not
    trained on."""
    if not is_deviceless(cfg):
        return
    if not cfg.gate.only:
        raise ConfigError("gate.target", cfg.gate.target,
                          f"this job has no {cfg.gate.target}: add gate.only=true to gate for "
                          "it from here, or use gate.target=local to train")
    try:
        hardware.ensure_gpu_compile()
    except hardware.GpuCompileUnavailable as e:
        raise ConfigError("gate.target", cfg.gate.target, str(e)) from None


def make_mesh(cfg: RunConfig) -> Mesh:
    """The run's 1-d data mesh.

    Deviceless: `mesh.hosts x mesh.gpus_per_host` compile-only GPUs of `gate.target`.
    Local: `mesh.data` devices, else the planned hosts x gpus_per_host when given, else the
    most devices that divide the batch.
    """
    me = cfg.mesh
    if is_deviceless(cfg):  # preflight's check_target made the compile plugin available
        return hardware.topology_mesh(cfg.gate.target, me.hosts, max(me.gpus_per_host, 1), AXIS)
    devices = jax.devices()
    n = me.data or (me.hosts * me.gpus_per_host if me.gpus_per_host else
                    max(k for k in range(1, len(devices) + 1) if cfg.data.batch_size % k == 0))
    processes = {d.process_index for d in devices[:n]}
    if len(processes) < jax.process_count():  # a process with no device would have no work
        raise ConfigError("mesh.data", n, f"the mesh must take devices of all "
                          f"{jax.process_count()} processes of this job ({len(devices)} "
                          f"devices): make data.batch_size a multiple of {len(devices)}")
    return Mesh(np.array(devices[:n]), (AXIS,))


def fsdp_spec(shape: tuple[int, ...], n: int) -> P:
    """Split the largest dimension that `n` divides; replicate a leaf that has none."""
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if n > 1 and shape[i] % n == 0:
            return P(*(AXIS if j == i else None for j in range(len(shape))))
    return P()


def place(tree: Any, mesh: Mesh, shard: bool) -> Any:
    """ShapeDtypeStructs of `tree`'s array leaves carrying their shardings."""

    def leaf(x):
        spec = fsdp_spec(x.shape, mesh.size) if shard else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree.map(leaf, tree)


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

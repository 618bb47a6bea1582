"""GPUs a run can be gated for without having them: their figures, and a compile-only mesh;
and the share of a GPU's memory a job's allocator may use.

XLA:GPU plans memory from a GpuTargetConfigProto: it rematerializes toward a limit derived
from `device_memory_size` (about 0.8 x the size), so the size must be the real card's or the
prediction is for another program. Only the device figures matter for memory planning; the
per-unit rate tables, which feed the cost model only, are left out.

The CUDA compile plugin (jax-cuda12-plugin + jax-cuda12-pjrt at jaxlib's version) lives
outside site-packages (`make install-gpu-compile` puts it in `<venv>/gpu-compile`): loaded on every
`import jax` it would log a missing-driver warning on each CPU-only run. It is loaded here,
on demand, only when a deviceless target is asked for.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax.experimental import topologies
from jax.sharding import Mesh

from pdecomp.core.config import ConfigError


@dataclass(frozen=True)
class GpuSpec:
    """Published figures of one card, as XLA's GPU device description wants them."""

    name: str  # the device description CUDA reports
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int  # what the driver reports as total memory, not the marketing figure
    memory_bandwidth: int  # bytes/s
    l2_bytes: int
    clock_ghz: float
    mem_clock_khz: int
    # Published rates, for the gate's time model only (pdecomp.gate.step_cost): dense bf16 and
    # TF32 matmul FLOP/s (XLA runs a float32 product on TF32 tensor cores at jax's default
    # precision), NVLink bytes/s one way per GPU, inter-host network bytes/s per GPU (one
    # 400 Gb/s NIC per GPU, as DGX H100, H200 and B200 systems have).
    bf16_flops: float = 989.4e12
    tf32_flops: float = 494.7e12
    nvlink_bandwidth: float = 450e9
    network_bandwidth: float = 50e9
    shared_memory_per_sm: int = 233_472  # 228 KiB on sm_90 and sm_100
    shared_memory_per_block_optin: int = 232_448
    pcie_bandwidth: int = 34_359_738_368

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), sm_count=132, memory_bytes=84_942_979_072,
                    memory_bandwidth=3_352_320_000_000, l2_bytes=50 * 2**20, clock_ghz=1.98,
                    mem_clock_khz=2_619_000),
    "h200": GpuSpec("NVIDIA H200", (9, 0), sm_count=132, memory_bytes=151_397_597_184,
                    memory_bandwidth=4_800_000_000_000, l2_bytes=50 * 2**20, clock_ghz=1.98,
                    mem_clock_khz=3_201_000),
    "b200": GpuSpec("NVIDIA B200", (10, 0), sm_count=148, memory_bytes=191_514_411_008,
                    memory_bandwidth=7_672_320_000_000, l2_bytes=132_644_864, clock_ghz=1.965,
                    mem_clock_khz=3_996_000, pcie_bandwidth=68_719_476_736,
                    bf16_flops=2.25e15, tf32_flops=1.1e15, nvlink_bandwidth=900e9),
}


def spec_of(target: str, device_kind: str) -> GpuSpec | None:
    """The card a gate is for: its GPU target's, else the local device's, by the kind CUDA
    reports (None: not a GPU in the table)."""
    return GPUS.get(target) or next((g for g in GPUS.values() if g.name == device_kind), None)


def card_bytes(device_kind: str) -> int | None:
    """The memory of a card in the table, by the device kind CUDA reports (None: unknown)."""
    return next((g.memory_bytes for g in GPUS.values() if g.name == device_kind), None)


# -- The device memory a job may use: one setting for the gate's cap and the job's allocator

# jax's GPU client sizes its memory pool from these when its backend starts (jaxlib's
# xla_client.generate_pjrt_gpu_plugin_options, jax 0.10 and 0.11): the fraction of the card
# under either name (the second is the older one; both set is an error there), 0.75 when
# unset; whether the pool is taken at start; and which allocator.
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
PREALLOCATE, ALLOCATOR = "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR"
MEMORY_VARS = (*MEM_FRACTION_VARS, PREALLOCATE, ALLOCATOR)
SAFETY_FRACTION = "memory.safety_fraction"
# What this process exported itself: a later job of the same process (an in-process sweep)
# must not take it for a setting of the user's.
_exported: dict[str, str] = {}


@dataclass(frozen=True)
class UsableMemory:
    """The fraction of a GPU's memory a job may use: the size of its allocator's pool, and
    what the gate caps at (card memory x fraction), so a yes of the gate fits the job."""

    fraction: float
    source: str  # SAFETY_FRACTION, or the variable of the user's it was read from
    export: dict[str, str]  # what a job sets before JAX starts ({}: the user's setting holds)
    note: str  # what the user's allocator settings make of the cap; "" for jax's defaults
    pooled: bool  # the allocator keeps to a pool of that size (not the platform allocator)

    def describe(self) -> str:
        if self.export:
            var, value = next(iter(self.export.items()))
            return f"{SAFETY_FRACTION}, which the job exports as {var}={value}"
        return f"from {self.source}, which the job keeps"

    def record(self, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """gate.json's `memory_env`: the fraction, where it came from, what the job exports,
        and the allocator variables as this process has them."""
        environ = os.environ if environ is None else environ
        return {"fraction": self.fraction, "source": self.source, "job_exports": self.export,
                "env": {v: environ.get(v) for v in MEMORY_VARS}, "note": self.note}


def _users(environ: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables the user set: those this process exported are left out."""
    return {v: environ[v] for v in MEMORY_VARS
            if environ.get(v) and _exported.get(v) != environ[v]}


def usable_memory(safety_fraction: float, environ: Mapping[str, str] | None = None
                  ) -> UsableMemory:
    """The usable fraction: `memory.safety_fraction`, which jobs export as the allocator's
    fraction, unless the user set one of MEM_FRACTION_VARS: then that value, which the job
    keeps. Raises ConfigError on a value jax would refuse or could not honour."""
    users = _users(os.environ if environ is None else environ)
    given = [v for v in MEM_FRACTION_VARS if v in users]
    if len(given) == 2:
        raise ConfigError(given[1], users[given[1]], f"jax refuses it together with "
                          f"{given[0]}={users[given[0]]!r}; unset one of them")
    if given:
        fraction, source, export = _fraction(given[0], users[given[0]]), given[0], {}
    else:
        fraction, source, export = safety_fraction, SAFETY_FRACTION, _export(safety_fraction)
    allocator = users.get(ALLOCATOR, "default").lower()
    note = ""
    if allocator == "platform":
        note = (f"{ALLOCATOR}=platform: no pool, memory is allocated as needed and the "
                f"fraction is not enforced; the cap is the gate's alone")
    elif users.get(PREALLOCATE, "").strip() in ("false", "False", "0"):
        note = (f"{PREALLOCATE}={users[PREALLOCATE]}: the pool grows to the fraction as "
                f"needed instead of being taken at start; fragmentation, which the gate "
                f"does not count, is more likely")
    return UsableMemory(fraction, source, export, note, pooled=allocator != "platform")


def _export(safety_fraction: float) -> dict[str, str]:
    return {MEM_FRACTION_VARS[0]: str(safety_fraction)}


def _fraction(var: str, value: str) -> float:
    try:
        fraction = float(value)
    except ValueError:
        fraction = float("nan")
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(var, value, "the fraction of GPU memory a job may use must be a "
                          "number in (0, 1]")
    return fraction


def export_job_memory(safety_fraction: float,
                      environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """In a job process, before JAX starts its backend: set the allocator's fraction to the
    one the gate caps at (`usable_memory`). A setting of the user's stays; one jax would
    refuse is left for the job's checks (`pdecomp.run.decompose.preflight`) to report. Returns what
    was set."""
    environ = os.environ if environ is None else environ
    if any(v in _users(environ) for v in MEM_FRACTION_VARS):
        return {}
    export = _export(safety_fraction)
    environ.update(export)
    _exported.update(export)
    return export


def target_config(spec: GpuSpec) -> str:
    """The text-format GpuTargetConfigProto XLA compiles against."""
    major, minor = spec.compute_capability
    arch = f"sm_{major}.{minor}a"
    info = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32,
        "shared_memory_per_block": 49_152, "shared_memory_per_core": spec.shared_memory_per_sm,
        "threads_per_core_limit": 2048, "core_count": spec.sm_count, "fpus_per_core": 128,
        "block_dim_limit_x": 2_147_483_647, "block_dim_limit_y": 65_535,
        "block_dim_limit_z": 65_535, "memory_bandwidth": spec.memory_bandwidth,
        "l2_cache_size": spec.l2_bytes, "clock_rate_ghz": spec.clock_ghz,
        "device_memory_size": spec.memory_bytes,
        "shared_memory_per_block_optin": spec.shared_memory_per_block_optin,
        "registers_per_core_limit": 65_536, "registers_per_block_limit": 65_536,
        "thread_dim_limit_x": 1024, "thread_dim_limit_y": 1024, "thread_dim_limit_z": 64,
        "device_address_bits": 64, "pcie_bandwidth": spec.pcie_bandwidth,
    }
    lines = ["gpu_device_info {"]
    lines += [f"  {k}: {v}" for k, v in info.items()]
    lines += [
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        '  device_vendor: "NVIDIA Corporation"',
        f'  platform_version: "Compute Capability {major}.{minor}a"',
        (f'  model_str: "{arch} with {spec.memory_bytes}B RAM, {spec.sm_count} cores, '
         f'{int(spec.clock_ghz * 1e6)}KHz clock, {spec.mem_clock_khz}KHz mem clock, '
         f'{spec.l2_bytes}B L2$"'),
        f'  name: "{spec.name}"',
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info { major: 9 minor: 10 }",
        f'device_description_str: "{spec.name}"',
    ]
    return "\n".join(lines) + "\n"


# A compile-only GPU cannot time kernels: autotuning there only compiles the candidate
# configurations of every fusion and keeps a default. Under jaxlib 0.11 that was half of the
# 8B preset's compile (config-assigner, 49 of 103 s of XLA passes), and turning it off left
# every figure of the gate unchanged in each configuration measured (bench/RESULTS.md).
DEVICELESS_XLA_FLAGS = "--xla_gpu_autotune_level=0"


def _jax_has_cuda() -> bool:
    """An installed CUDA backend for jax (what a GPU machine has): its jobs autotune."""
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None
                   for v in (12, 13))
    except ModuleNotFoundError:  # no jax plugin of any kind
        return False


def no_gpu_autotuning_without_gpus() -> None:
    """Before JAX starts its backends: a process whose jax has no CUDA backend compiles for
    GPUs only deviceless, so XLA's GPU autotuning is turned off (DEVICELESS_XLA_FLAGS). A
    flag of the process, not a compile option: jax builds every compile's debug options from
    the flags it parsed at start-up, and the autotuner ignored the same setting given as a
    compile option. A setting of the user's own in XLA_FLAGS wins."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_autotune_level" in flags or _jax_has_cuda():
        return
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICELESS_XLA_FLAGS}".strip()


class GpuCompileUnavailable(RuntimeError):
    pass


def plugin_dir() -> Path:
    return Path(os.environ.get("PDECOMP_GPU_COMPILE_DIR", Path(sys.prefix) / "gpu-compile"))


@contextlib.contextmanager
def _quiet_stderr():
    """The plugin's C++ side logs, on import, that this host has no CUDA driver: expected on a
    compile-only host, and noise in the report."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _load_cuda_plugin() -> None:
    path = plugin_dir()
    if not (path / "jax_plugins").is_dir():
        raise GpuCompileUnavailable(
            f"deviceless GPU compile needs jax-cuda12-plugin and jax-cuda12-pjrt "
            f"{jax.__version__} in {path} (`make install-gpu-compile` puts them there)")
    if str(path) not in sys.path:
        sys.path.append(str(path))
    # Without an explicit platform list the plugin checks for a CUDA runtime and gives up.
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    with _quiet_stderr():
        importlib.import_module("jax_plugins.xla_cuda12").initialize()


def _topology(gpu: str, hosts: int, gpus_per_host: int) -> topologies.TopologyDescription:
    return topologies.get_topology_desc(platform="cuda", target_config=target_config(GPUS[gpu]),
                                        topology=f"1x{hosts}x{gpus_per_host}")


@functools.cache
def ensure_gpu_compile() -> None:
    """Make CUDA compile-only devices available: through an installed CUDA jax, else by
    loading the plugin from `plugin_dir()`. Raises GpuCompileUnavailable (not cached)."""
    try:
        _topology("h100", 1, 1)
    except NotImplementedError:
        _load_cuda_plugin()


def topology_mesh(gpu: str, hosts: int, gpus_per_host: int,
                  axes: tuple[tuple[str, int], ...]) -> Mesh:
    """A compile-only mesh of `hosts x gpus_per_host` GPUs of kind `gpu`, with named axes of
    the given sizes (the last one varies fastest, so it stays within a host)."""
    ensure_gpu_compile()
    return topologies.make_mesh(_topology(gpu, hosts, gpus_per_host),
                                tuple(n for _, n in axes), tuple(a for a, _ in axes))

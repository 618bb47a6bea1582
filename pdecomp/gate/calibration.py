"""What one device achieves, as data: the rates the gate's forecast (pdecomp.gate.forecast)
reads, by the size of the work, from a microbenchmark of that device
(pdecomp.gate.microbench) or, for a card nobody has measured, from published figures
(`source` says which).

A card's file lives beside this module (`calibrations/<card>.json`); the device at hand is
measured the first time a gate needs it (pdecomp.gate.microbench.local) and cached under
PDECOMP_CALIBRATION_DIR (default ~/.cache/pdecomp/calibration), keyed by what the rates
depend on: the device, the CPU model, its core count and jaxlib. PDECOMP_CALIBRATION=FILE
names a file to use instead.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdecomp.core import storage
from pdecomp.core.config import ConfigError

CARDS = Path(__file__).parent / "calibrations"
FILE_VAR, DIR_VAR = "PDECOMP_CALIBRATION", "PDECOMP_CALIBRATION_DIR"


@dataclass(frozen=True)
class Curve:
    """A rate (per second) against the size of one kernel's work, measured at a few sizes:
    between two of them log-linear, beyond them the nearest one's rate."""

    points: tuple[tuple[float, float], ...]  # (size, rate), sizes increasing

    def __call__(self, size: float) -> float:
        sizes = [s for s, _ in self.points]
        i = bisect.bisect_left(sizes, size)
        if i == 0 or size <= 0:
            return self.points[0][1]
        if i == len(sizes):
            return self.points[-1][1]
        (s0, r0), (s1, r1) = self.points[i - 1], self.points[i]
        w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp((1 - w) * math.log(r0) + w * math.log(r1))

    @property
    def peak(self) -> float:
        return max(r for _, r in self.points)


@dataclass(frozen=True)
class Link:
    """A collective over one kind of link: alpha-beta, the bandwidth's efficiency by size."""

    latency_s: float  # alpha, per collective
    bandwidth: Curve  # achieved bytes/s one way per device, by message bytes

    def seconds(self, sent_bytes: float) -> float:
        return self.latency_s + sent_bytes / self.bandwidth(sent_bytes)


@dataclass(frozen=True)
class Calibration:
    """The rates of one device: matmul FLOP/s by FLOPs per dtype of its operands, memory
    bytes/s (read + written) by bytes, elementwise operations and transcendentals per second
    by elements, the fixed cost of each kernel, and collectives by link."""

    device: str
    source: str  # "measured ..." (a microbenchmark's run) or "published ..." (no card measured)
    launch_s: float
    matmul: dict[str, Curve]  # operand dtype ("float32", "bfloat16") -> FLOP/s by FLOPs
    memory: Curve  # bytes/s by bytes a kernel reads and writes
    elementwise: Curve  # cheap operations (add, compare, shift...) per s by op-elements
    transcendental: Curve  # tanh per s by op-elements
    # seconds of one element of each other transcendental op, in tanh's (absent: 1)
    transcendental_cost: dict[str, float] = field(default_factory=dict)
    dispatch_s: float = 0.0  # once per step: the program's dispatch beside its kernels
    # bytes/s of memory first touched in a run: XLA:CPU's temporaries are allocated anew
    # each run and, above `fresh_threshold_bytes`, mapped anew (0: none, a GPU's pool)
    fresh_bytes_rate: float = 0.0
    fresh_threshold_bytes: int = 32 * 2**20
    links: dict[str, Link] = field(default_factory=dict)  # "nvlink", "network"
    # seconds of one run of each of a step's own dots, measured on this device with cold
    # operands (pdecomp.gate.dots), by signature (step_cost.dot_signature)
    dot_seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # where each figure came from

    def matmul_rate(self, dtype: str, flops: float) -> float:
        curve = self.matmul.get(dtype) or self.matmul["float32"]
        return curve(flops)

    def dot_time(self, signature: str, dtype: str, flops: float) -> float:
        """One dot's seconds: at the rate of square products of its FLOPs, or slower
        where its own shape was measured slower (a thin product: up to several times).
        Never faster: alone, a step's large dots ran 10-25% faster than they do among the
        step's other kernels (bench/RESULTS.md, the SmolLM2 step), at about the square
        products' rate."""
        return max(flops / self.matmul_rate(dtype, flops), self.dot_seconds.get(signature, 0.0))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> Calibration:
        def curve(c: dict[str, Any]) -> Curve:
            return Curve(tuple((float(s), float(r)) for s, r in c["points"]))

        return Calibration(
            device=d["device"], source=d["source"], launch_s=float(d["launch_s"]),
            matmul={k: curve(v) for k, v in d["matmul"].items()}, memory=curve(d["memory"]),
            elementwise=curve(d["elementwise"]), transcendental=curve(d["transcendental"]),
            transcendental_cost={k: float(v)
                                 for k, v in d.get("transcendental_cost", {}).items()},
            dispatch_s=float(d.get("dispatch_s", 0.0)),
            fresh_bytes_rate=float(d.get("fresh_bytes_rate", 0.0)),
            fresh_threshold_bytes=int(d.get("fresh_threshold_bytes", 32 * 2**20)),
            links={k: Link(float(v["latency_s"]), curve(v["bandwidth"]))
                   for k, v in d.get("links", {}).items()},
            notes=dict(d.get("notes", {})),
            dot_seconds={k: float(v) for k, v in d.get("dot_seconds", {}).items()})


def read(path: Path) -> Calibration:
    """A calibration file; ConfigError naming it where it is not one."""
    try:
        return Calibration.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ConfigError(FILE_VAR, str(path), f"a calibration file that "
                          f"pdecomp.gate.microbench wrote ({type(e).__name__}: {e})") from None


def write(cal: Calibration, path: Path) -> None:
    """Written whole or not at all (a half-written cache would be read as a calibration);
    storage.WriteFailed on a full disk."""
    write_json(cal.to_json(), path)


def write_json(data: dict[str, Any], path: Path) -> None:
    """A cache file written whole or not at all; storage.WriteFailed on a full disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    storage.write_text(path, json.dumps(data, indent=1) + "\n")


def for_card(card: str) -> Calibration:
    """The calibration file of a card of the hardware table (h100, h200, b200)."""
    return read(CARDS / f"{card}.json")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dots_cache_path(device_kind: str) -> Path:
    """Where the seconds of the dots measured on the local device are cached (beside its
    calibration: {signature: seconds})."""
    path = cache_path(device_kind)
    return path.with_name(path.stem + "-dots.json")


def cache_path(device_kind: str) -> Path:
    """Where the local device's measured calibration is cached: one file per thing the
    rates depend on."""
    import jaxlib

    key = json.dumps([device_kind, cpu_model(), os.cpu_count(), jaxlib.__version__])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(os.environ.get(DIR_VAR) or Path.home() / ".cache" / "pdecomp" / "calibration")
    return root / f"{device_kind.replace(' ', '_').replace('/', '_')}-{digest}.json"

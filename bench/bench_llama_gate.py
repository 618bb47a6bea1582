"""The Llama-3.1-8B layers 18-26 chunkwise preset, gated deviceless for 64 B200s.

`pdecomp +experiment=llama8b_l18-26_chunkwise gate.only=true gate.target=b200 mesh=fsdp64`
end to end at batch 64/128/256 and seq 512/2048, beside the per-device peaks the seed's
own AOT probe reported (remat on, no donation); then what each memory knob changes at
B=128, seq 512, as a ratio against the preset. Prints two tables and writes the rows to
bench/llama_gate.json. Run: `make bench` (needs `make install-gpu-compile`), about 20 min
on a 2-core host.
"""

from __future__ import annotations

import json
import os
import tempfile

from bench_gate import gate_only  # bench/ is on the path when a script there runs
from rich.console import Console
from rich.table import Table

from pdecomp.units import GiB

BASE = ["+experiment=llama8b_l18-26_chunkwise", "gate.target=b200", "mesh=fsdp64"]
# The seed's probe (64 B200, remat on, no buffer donation), GiB per device.
SEED = {(512, 64): "144.8", (512, 128): "144.8-150.3", (512, 256): "150.3",
        (2048, 64): "179.0", (2048, 128): "210.2"}
KNOBS: list[tuple[str, list[str]]] = [
    ("preset (remat full, bf16 target + compute, donate)", []),
    ("memory.remat=none", ["memory.remat=none"]),
    ("memory.remat=save_dots", ["memory.remat=save_dots"]),
    ("memory.remat=names [layer_out]", ["memory.remat=names"]),
    ("memory.remat=offload [layer_out]", ["memory.remat=offload"]),
    ("memory.target_dtype=float32", ["memory.target_dtype=float32"]),
    ("memory.compute_dtype=float32", ["memory.compute_dtype=float32"]),
    ("memory.donate=false", ["memory.donate=false"]),
]


def gib(rep: dict, key: str) -> str:
    return f"{rep[key] / GiB:.1f}"


def main() -> None:
    console = Console(width=140)
    rows = []
    shapes = Table(title="llama8b_l18-26_chunkwise on 64 x B200 (deviceless), per device")
    for col in ("seq", "batch", "peak GiB", "seed GiB", "temp GiB", "argument GiB", "alias GiB",
                "fits (cap 160.5)", "compile s", "wall s"):
        shapes.add_column(col)
    knobs = Table(title="memory knobs at B=128, seq 512 (64 x B200), per device")
    for col in ("knob", "peak GiB", "temp GiB", "argument GiB", "host temp GiB", "peak / preset",
                "compile s"):
        knobs.add_column(col)
    with tempfile.TemporaryDirectory() as d:
        for seq in (512, 2048):
            for batch in (64, 128, 256):
                wall, rep = gate_only([*BASE, f"data.seq_len={seq}", f"data.batch_size={batch}"],
                                      f"{d}/{seq}-{batch}")
                rows.append({"seq": seq, "batch": batch, "wall_s": wall, **rep})
                shapes.add_row(str(seq), str(batch), gib(rep, "peak_bytes"),
                               SEED.get((seq, batch), "-"), gib(rep, "temp_bytes"),
                               gib(rep, "argument_bytes"), gib(rep, "alias_bytes"),
                               "yes" if rep["fits"] else "no", f"{rep['compile_s']:.1f}",
                               f"{wall:.1f}")
        base = None
        for i, (name, args) in enumerate(KNOBS):
            wall, rep = gate_only([*BASE, *args], f"{d}/knob{i}")
            rows.append({"knob": name, "wall_s": wall, **rep})
            base = base or rep["peak_bytes"]
            knobs.add_row(name, gib(rep, "peak_bytes"), gib(rep, "temp_bytes"),
                          gib(rep, "argument_bytes"), gib(rep, "host_temp_bytes"),
                          f"{rep['peak_bytes'] / base:.3f}", f"{rep['compile_s']:.1f}")
    console.print(shapes)
    console.print(knobs)
    out = os.path.join(os.path.dirname(__file__), "llama_gate.json")
    with open(out, "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "largest_temps"} for r in rows], f,
                  indent=1)


if __name__ == "__main__":
    main()

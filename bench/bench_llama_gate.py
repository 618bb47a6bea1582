"""The Llama-3.1-8B layers 18-26 chunkwise preset, gated deviceless for 64 B200s.

`pdecomp +experiment=llama8b_l18-26_chunkwise gate.only=true gate.target=b200 mesh=fsdp8x8`
end to end at seq 512/2048 and batch 64-512 (the preset's 16 microbatches; 8 at batch 64,
whose 16 would leave a microbatch fewer examples than the 8 data-axis devices), beside the
per-device peaks the seed's own AOT probe reported (remat on, no donation); then what each
memory knob changes at seq 2048, batch 256, as ratios of the peak and of the step's FLOPs
against the preset: its matmul FLOPs (loops times their trip count, recomputation
included; a gate-only deviceless run has no XLA cost analysis to compare). Prints two tables and writes the rows to bench/llama_gate.json. Run:
`make bench` (needs `make install-gpu-compile`), about 30 min on a 2-core host;
`--knobs` redoes the knob table only (the shape rows of the json are kept).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from bench_gate import gate_only  # bench/ is on the path when a script there runs
from rich.console import Console
from rich.table import Table

from pdecomp.core.units import GiB

BASE = ["+experiment=llama8b_l18-26_chunkwise", "gate.target=b200", "mesh=fsdp8x8"]
# The seed's probe (64 B200, remat on, no buffer donation), GiB per device.
SEED = {(512, 64): "144.8", (512, 128): "144.8-150.3", (512, 256): "150.3",
        (2048, 64): "179.0", (2048, 128): "210.2"}
SHAPES = [(seq, batch, 8 if batch == 64 else 16) for seq in (512, 2048)
          for batch in (64, 128, 256, 512)] + [(2048, 512, 32)]
KNOB_AT = ["data.seq_len=2048", "data.batch_size=256"]
KNOBS: list[tuple[str, list[str]]] = [
    (("preset (fsdp8x8, 16 microbatches of 2 per data-axis device, stream_ci, "
     "remat_layers, remat full)"), []),
    ("memory.stream_ci=false", ["memory.stream_ci=false"]),
    ("memory.remat_layers=false", ["memory.remat_layers=false"]),
    ("optim.microbatches=8", ["optim.microbatches=8", "optim.microbatch_size=0"]),
    ("mesh=fsdp64 (no model axis), optim.microbatches=4", ["mesh=fsdp64",
                                                           "optim.microbatches=4",
                                                           "optim.microbatch_size=0"]),
    ("memory.offload_opt_state=true (deviceless: upper bound)",
     ["memory.offload_opt_state=true"]),
]


def ratio(rep: dict, base: dict, key: str) -> str:
    return f"{rep[key] / base[key]:.3f}" if rep.get(key) and base.get(key) else "n/a"


def gib(rep: dict, key: str) -> str:
    return f"{rep[key] / GiB:.1f}"


def main() -> None:
    knobs_only = "--knobs" in sys.argv[1:]
    console = Console(width=170)
    out = os.path.join(os.path.dirname(__file__), "llama_gate.json")
    rows = []
    if knobs_only:
        with open(out) as f:
            rows = [r for r in json.load(f) if "knob" not in r]
    shapes = Table(title="llama8b_l18-26_chunkwise on 64 x B200 (deviceless, mesh fsdp8x8), "
                         "per device")
    for col in ("seq", "batch", "microbatches", "peak GiB", "seed GiB", "temp GiB",
                "argument GiB", "fits (cap 160.5)", "headroom", "compile s", "wall s"):
        shapes.add_column(col)
    knobs = Table(title="memory knobs at seq 2048, batch 256 (64 x B200), per device")
    for col in ("knob", "peak GiB", "temp GiB", "argument GiB", "fits", "peak / preset",
                "matmul TFLOP / device", "matmul FLOPs / preset",
                "compile s"):
        knobs.add_column(col)
    with tempfile.TemporaryDirectory() as d:
        for seq, batch, micro in [] if knobs_only else SHAPES:
            wall, rep = gate_only([*BASE, f"data.seq_len={seq}", f"data.batch_size={batch}",
                                   f"optim.microbatches={micro}", "optim.microbatch_size=0"],
                               f"{d}/{seq}-{batch}-{micro}")
            rows.append({"seq": seq, "batch": batch, "microbatches": micro, "wall_s": wall,
                         **rep})
            shapes.add_row(str(seq), str(batch), str(micro), gib(rep, "peak_bytes"),
                           SEED.get((seq, batch), "-"), gib(rep, "temp_bytes"),
                           gib(rep, "argument_bytes"), "yes" if rep["fits"] else "no",
                           f"{rep['headroom_bytes'] / rep['cap_bytes']:.0%}",
                           f"{rep['compile_s']:.1f}", f"{wall:.1f}")
        base = None
        for i, (name, args) in enumerate(KNOBS):
            if not args and not knobs_only:  # the preset: the seq 2048, batch 256 row above
                rep = next(r for r in rows if r.get("seq") == 2048 and r.get("batch") == 256
                           and r.get("microbatches") == 16)
                wall = rep["wall_s"]
            else:
                wall, rep = gate_only([*BASE, *KNOB_AT, *args], f"{d}/knob{i}")
            rows.append({"knob": name, "wall_s": wall, **rep})
            base = base or rep
            tflop = (f"{rep['matmul_flops'] / rep['n_devices'] / 1e12:.0f}"
                     if rep.get("matmul_flops") else "n/a")
            knobs.add_row(name, gib(rep, "peak_bytes"), gib(rep, "temp_bytes"),
                          gib(rep, "argument_bytes"), "yes" if rep["fits"] else "no",
                          f"{rep['peak_bytes'] / base['peak_bytes']:.3f}", tflop,
                          ratio(rep, base, "matmul_flops"),
                          f"{rep['compile_s']:.1f}")
    if not knobs_only:
        console.print(shapes)
    console.print(knobs)
    with open(out, "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "largest_temps"} for r in rows], f,
                  indent=1)


if __name__ == "__main__":
    main()

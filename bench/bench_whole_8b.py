"""The whole Llama-3.1-8B (`+experiment=llama8b_all`, 224 sites) gated deviceless for B200s
at each batch and mesh, and the seed preset (`seed_b256_x64`): peak, largest buffers, FLOPs,
collective bytes, the forecast step (pdecomp.gate.forecast at the B200's calibration file)
and its floor; the rows go into bench/results.json under "whole_8b" (bench/RESULTS.md's
table).

    .venv/bin/python bench/bench_whole_8b.py                 # every case (minutes each)
    .venv/bin/python bench/bench_whole_8b.py b128_x32         # one of them
    .venv/bin/python bench/bench_whole_8b.py b128_x32=DIR     # read a gate already run in DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench_gate import gate_only  # bench/ is on the path when a script there runs

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.json"
WHOLE = "+experiment=llama8b_all"
CASES = {  # name: (overrides, GPUs, positions a step)
    "b128_x32": (["mesh=fsdp4x8", "data.batch_size=128"], 32, 128 * 512),
    "b256_x32": (["mesh=fsdp4x8", "data.batch_size=256"], 32, 256 * 512),
    "b1024_x128": (["mesh=fsdp16x8", "data.batch_size=1024"], 128, 1024 * 512),
    # more, smaller microbatches: each one's gradient reduction crosses the hosts
    "b128_x32_mb8": (["mesh=fsdp4x8", "data.batch_size=128", "optim.microbatch_size=8"], 32,
                     128 * 512),
    "b128_x32_mb4": (["mesh=fsdp4x8", "data.batch_size=128", "optim.microbatch_size=4"], 32,
                     128 * 512),
    # the weights split over data too (ZeRO-3), gathered per microbatch: for comparison
    "b128_x32_zero3": (["mesh=fsdp4x8", "data.batch_size=128", "mesh.shard_weights=true"], 32,
                       128 * 512),
    # the seed's run (27 sites of layers 18-26) as bench/RESULTS.md's memory table gates it
    "seed_b256_x64": (["+experiment=llama8b_l18-26_chunkwise", "mesh=fsdp8x8",
                       "data.seq_len=2048", "data.batch_size=256"], 64, 256 * 2048),
}


def row(name: str, report: dict, wall_s: float | None) -> dict:
    _, gpus, positions = CASES[name]
    step = report["step"] or {}
    t, f = step.get("time") or {}, step.get("forecast") or {}
    return {"case": name, "gpus": gpus, "batch_positions": positions,
            "peak_gib": report["peak_bytes"] / 2**30, "fits": report["fits"],
            "cap_gib": report["cap_bytes"] / 2**30,
            "argument_parts_gib": {k: v / 2**30 for k, v in
                                   report["argument_parts_bytes"].items()},
            "largest_temps": report["largest_temps"][:3],
            "matmul_flops": report["matmul_flops"], "flops_per_device": step.get("flops"),
            "hbm_bytes_per_device": step.get("hbm_bytes"),
            "collectives": step.get("collectives"), "time": t,
            "tokens_per_s_per_gpu": positions / t["roofline_s"] / gpus if t else None,
            "forecast": f, "forecast_s": f.get("s_per_step"),
            "forecast_tokens_per_s_per_gpu": positions / f["s_per_step"] / gpus if f else None,
            "compile_s": report["compile_s"], "wall_s": wall_s}


def main(argv: list[str]) -> None:
    wanted = argv or list(CASES)
    rows = {r["case"]: r for r in json.loads(RESULTS.read_text())["whole_8b"]["rows"]}
    for item in wanted:
        name, _, given = item.partition("=")
        if given:
            report, wall = json.loads((Path(given) / "gate.json").read_text()), None
        else:
            with tempfile.TemporaryDirectory() as tmp:
                overrides = CASES[name][0]
                preset = [] if overrides[0].startswith("+experiment=") else [WHOLE]
                wall, report = gate_only([*preset, "gate.target=b200", *overrides],
                                         str(Path(tmp) / "run"))
        rows[name] = row(name, report, wall)
        print(json.dumps(rows[name], default=str))
        # read again: other benches may have written their figures while this one compiled
        data = json.loads(RESULTS.read_text())
        data["whole_8b"] = {"command": "bench/bench_whole_8b.py", "rows": list(rows.values())}
        RESULTS.write_text(json.dumps(data, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

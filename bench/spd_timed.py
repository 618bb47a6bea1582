"""Run the PyTorch SPD reference's LM decomposition on one config and time its steady-state
step in the same process: `python bench/spd_timed.py CONFIG.json` (PYTHONPATH holding the
reference's checkout; `bench_spd_reference.py` and `gpu_suite.py` call it).

The reference's training loop iterates `tqdm(range(steps + 1))`; this driver hands it a
tqdm that notes the time each step begins. s/step is the time from the start of step
`--skip` to the start of the last iteration (every training step done), over the steps
between, with the device synchronized at both ends: start-up, data loading, the step-0
evaluation and the first steps' warm-up are excluded, and nothing is added inside the loop.
Prints one JSON line: step_s, steps timed, and the device's peak allocated bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def timed_tqdm(marks: list[float], sync):
    import tqdm

    class Timed(tqdm.tqdm):
        """tqdm that records when each iteration of the training loop begins."""

        def __iter__(self):
            for item in super().__iter__():
                if self.total is not None and self.total > 1 and self.total == self._loop:
                    sync()
                    marks.append(time.perf_counter())
                yield item

    return Timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", help="the reference's config as JSON")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the time")
    args = p.parse_args()
    import torch
    import tqdm

    cfg = json.loads(Path(args.config).read_text())
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    marks: list[float] = []
    Timed = timed_tqdm(marks, sync)
    Timed._loop = cfg["steps"] + 1  # the training loop's length: the tqdm to time
    tqdm.tqdm = Timed  # before the reference imports it
    from spd.experiments.lm import lm_decomposition

    lm_decomposition.main(config_path=args.config)
    if len(marks) < args.skip + 2:
        sys.exit(f"the reference ran {len(marks)} timed iterations, fewer than --skip + 2")
    # marks[i]: step i begins; marks[-1]: the last iteration (step == steps) begins
    n = len(marks) - 1 - args.skip
    print(json.dumps({"step_s": (marks[-1] - marks[args.skip]) / n, "steps_timed": n,
                      "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}))


if __name__ == "__main__":
    main()

"""The viewer of an analysed run, read in Chromium as the browser test reads llama_tiny's:
for every site, every component page by page, the frequency sort, a component found by a
token it fires on and each of its statistics against the Parquet table. The outcome and
its time go into bench/results.json under "analysis"/"view" (bench/RESULTS.md).

    .venv/bin/python bench/bench_view.py RUN_DIR
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_analyze import check_viewer  # the browser test's own checks

RESULTS = ROOT / "bench" / "results.json"


def main(run_dir: Path) -> None:
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed (apt-get install -y chromium)"
    tables = sorted((run_dir / "analysis" / "components").glob("*.parquet"))
    proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "pdecomp"), "view", str(run_dir),
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    sites = []
    try:
        url = proc.stdout.readline().strip()
        for table in tables:
            site, t0 = table.stem, time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                found = check_viewer(chromium, run_dir, url, site, Path(tmp))
            sites.append({"site": site, "components": pq.read_metadata(table).num_rows,
                          "found_by_token": found["input_tokens"][0]["token"],
                          "component": found["component"], "checked_s":
                          round(time.perf_counter() - t0, 1)})
            print(json.dumps(sites[-1]))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    data = json.loads(RESULTS.read_text())
    data["analysis"]["view"] = {"command": f"bench/bench_view.py {run_dir.name}",
                                "positions": pq.read_table(tables[0], columns=["positions"])[
                                    "positions"][0].as_py(), "sites": sites}
    RESULTS.write_text(json.dumps(data, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())

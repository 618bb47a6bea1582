"""The decomposition learns: a short TMS 5-2 run through the library API (slow tier)."""

from __future__ import annotations

import dataclasses as dc
import json

import pytest

from pdecomp.core.config import RunConfig
from pdecomp.run.decompose import decompose


@pytest.mark.slow
def test_short_tms_run_sparsifies_and_aligns(tmp_path):
    base = RunConfig()
    cfg = dc.replace(
        base,
        model=dc.replace(base.model, cache_dir=str(tmp_path / "cache"), train_steps=3000),
        optim=dc.replace(base.optim, steps=1500),
        data=dc.replace(base.data, batch_size=2048, eval_batches=2),
        logging=dc.replace(base.logging, log_every=250, ckpt_every=0))
    summary = decompose(cfg, tmp_path / "run")
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert history[0]["step"] == 1  # where it started; the comparison is from step 250
    first, last = history[1], history[-1]
    assert last["loss/imp_min"] < 0.7 * first["loss/imp_min"]  # CI becomes sparse
    assert last["train/l0/linear1"] < 0.6  # from ~1 per input toward 0.25
    assert 5 <= summary["live/linear1"] <= 12
    # each feature alone (0.75·e_f) turns on its own component, on both sites
    assert summary["live_one_hot/linear1"] >= 5 and summary["live_one_hot/linear2"] >= 5
    assert summary["mmcs/linear1"] > 0.9
    assert (tmp_path / "run" / "gate.json").exists() and summary["steps"] == 1500

"""A run resolved once: `resolve(cfg)` makes the frozen `Run` every layer below reads (the
batch plan, the placement, the step spec, absolute paths, provenance), the gate's searches
make new runs rather than rewrite a config, and run.json records what it resolved to."""

from __future__ import annotations

import dataclasses as dc
import json
import re
from pathlib import Path

import pytest

from pdecomp.core.config import DataConfig, RunConfig
from pdecomp.kinds import run_config
from pdecomp.plan.resolve import BatchPlan, resolve


def test_a_run_is_resolved_once_and_frozen():
    cfg = dc.replace(RunConfig(), data=dc.replace(RunConfig().data, batch_size=1024))
    run = resolve(cfg, n_devices=1)
    assert run.kind.schema.__name__ == "TMSConfig" and dict(run.sites) == {
        "linear1": 20, "linear2": 20}
    assert dict(run.tied) == {"linear2": "linear1"}
    assert run.batch == BatchPlan(1024, 1, 1) and run.batch.microbatch == 1024
    assert run.placement.deviceless is False and run.placement.data_axis == 1
    assert run.step.sites.names == ("linear1", "linear2") and run.step.positions == (1024,)
    assert run.config == run.composed == cfg  # nothing to resolve in a toy's config
    with pytest.raises(dc.FrozenInstanceError):
        run.batch = BatchPlan(1, 1, 1)  # type: ignore[misc]


def test_microbatch_size_settles_into_the_plan_and_the_step():
    cfg = dc.replace(RunConfig(), data=dc.replace(RunConfig().data, batch_size=4096),
                     optim=dc.replace(RunConfig().optim, microbatch_size=512))
    run = resolve(cfg, n_devices=2)
    assert run.batch == BatchPlan(4096, 4, 2) and run.batch.microbatch == 1024
    assert run.step.microbatches == 4 and run.config.optim.microbatches == 4
    assert run.composed.optim.microbatches == 1  # config.yaml keeps what was composed


def test_the_gates_searches_make_new_runs():
    run = resolve(RunConfig(), n_devices=1)
    bigger = run.with_batch(8192)
    assert (bigger.batch.size, bigger.step.positions, bigger.config.data.batch_size) == (
        8192, (8192,), 8192)
    assert run.batch.size == 4096 and run.step.positions == (4096,)  # the first is as it was
    split = run.with_microbatches(4)
    assert split.batch == BatchPlan(4096, 4, 1) and split.step.microbatches == 4
    assert split.composed is run.composed


def test_paths_are_made_absolute_against_the_working_directory(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    cfg = dc.replace(RunConfig(), data=DataConfig(source="tokens", path="text/topics.bin"))
    run = resolve(cfg, n_devices=1)
    assert run.config.data.path == str(tmp_path / "text" / "topics.bin")
    assert run.composed.data.path == "text/topics.bin"
    assert resolve(run.config, n_devices=1).config.data.path == run.config.data.path  # idempotent


def test_run_json_records_the_resolved_run_and_reads_back():
    cfg = dc.replace(RunConfig(), optim=dc.replace(RunConfig().optim, microbatches=2))
    run = resolve(cfg, n_devices=1)
    record = json.loads(json.dumps(run.record()))
    assert record["batch"] == {"size": 4096, "microbatches": 2, "data_axis": 1,
                               "microbatch": 2048}
    assert record["sites"] == {"linear1": 20, "linear2": 20} and record["kind"] == "tms"
    assert run_config(record["config"]) == run.config
    prov = record["provenance"]
    assert prov["jax"] and prov["python"] and prov["pdecomp"]
    if (Path(__file__).resolve().parents[1] / ".git").exists():  # a checkout: its commit
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", prov["commit"]), prov["commit"]


@pytest.mark.parametrize("weights", [True, False])
def test_shard_weights_splits_the_weights_over_data_or_only_the_moments(weights: bool) -> None:
    """FSDP on data 4 x model 2: a component's V splits its C on model either way; with
    `mesh.shard_weights` its other dimension (and the frozen target's largest) on data too,
    without it only the moments and the adversary split on data."""
    from jax.sharding import AbstractMesh

    from pdecomp.core.config import MeshConfig
    from pdecomp.core.sharding import leaf_sharding, make_layout

    me = MeshConfig(shard_state=True, shard_weights=weights, model=2)
    layout = make_layout(me, AbstractMesh((4, 2), ("data", "model")))
    g = "['layers.*.mlp.up_proj']"  # a group: its leaves stacked over 3 layers
    spec = {path: tuple(leaf_sharding(layout, path, shape).spec) for path, shape in (
        (f".components.groups{g}.V", (3, 64, 32)), (f".comp_opt[0].mu.groups{g}.V", (3, 64, 32)),
        (".attn['q_proj']", (64, 32)), (f".ci_fn.global_net.w_in{g}", (3, 64, 32)),
        (f".adversary.sources{g}", (3, 1, 64, 33)))}
    data = "data" if weights else None
    assert spec[f".components.groups{g}.V"] == (None, data, "model")
    assert spec[".attn['q_proj']"] == (data, None)
    assert spec[f".ci_fn.global_net.w_in{g}"] == (None, data, None)
    assert spec[f".comp_opt[0].mu.groups{g}.V"] == (None, "data", "model")
    assert spec[f".adversary.sources{g}"] == (None, None, "data", None)
    # mesh.rules.ci_in: the global CI transformer's input projection by rows over model (its
    # moments too), not a per-site CI function's
    split = make_layout(dc.replace(me, rules={**me.rules, "ci_in": "model"}),
                        AbstractMesh((4, 2), ("data", "model")))
    assert tuple(leaf_sharding(split, f".ci_fn.global_net.w_in{g}", (3, 64, 32)).spec) == \
        (None, "model", data)
    assert tuple(leaf_sharding(split, f".ci_opt[0].mu.global_net.w_in{g}", (3, 64, 32)).spec) \
        == (None, "model", "data")
    assert tuple(leaf_sharding(split, ".ci_fn.sites['a'].weights[0]", (3, 64, 32)).spec) == \
        (None, data, None)

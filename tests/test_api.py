"""The Python API as a notebook uses it: compose as the CLI would, run, open the run."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from conftest import pdecomp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from launcher import api
from pdecomp.kinds import toy as toys
from pdecomp.run.checkpoint import Checkpointer
from pdecomp.run.decompose import Hooks
from pdecomp.run.evaluation import evaluate
from pdecomp.spd import metrics
from pdecomp.spd.components import masked_linear

QUIET = Hooks(log=lambda _: None)


def test_compose_run_load_gives_the_runs_results(cache, tmp_path: Path) -> None:
    cfg = api.compose(["+experiment=tms_5-2", "optim.steps=200", "logging.plots=false"])
    assert cfg == api.compose(["optim.steps=200", "logging.plots=false"], preset="tms_5-2")
    assert cfg.optim.steps == 200 and cfg.model.name == "tms_5-2"
    summary = api.run(cfg, tmp_path / "run", QUIET)

    run = api.load_run(tmp_path / "run")
    assert run.config == cfg and run.step == 200 and run.summary == summary
    assert [h["step"] for h in run.history] == [1, 100, 200]
    assert run.gate is not None and run.gate["fits"]

    # The run's final evaluation, recomputed from what was loaded: the same CI on the same
    # held-out batches, the same ground-truth match (bit for bit: the same state).
    again, _ = evaluate(run.run, run.target, run.state, NamedSharding(run.mesh, P("data")))
    assert again == {k: summary[k] for k in again}

    # The masked forward of the loaded components: with the CI's masks (rounded at the
    # threshold) it is far closer to the target than ablating every component.
    x = toys.sample_inputs(jax.random.PRNGKey(1), cfg.model, 1000)
    lower = metrics.causal_importances(run.target, run.components, run.ci_fn, x)

    def error(kind: str) -> float:
        masks = metrics.eval_masks(kind, lower, jax.random.PRNGKey(0), cfg.loss.ci_threshold,
                                   delta=False)
        out = run.target(x, masked_linear(run.components, masks))
        return float(jnp.mean((out - run.target(x)) ** 2))

    assert error("rounded") < 0.5 * error("zero"), (error("rounded"), error("zero"))

    # A checkpoint laid out as before the state was stacked by group (components per site):
    # a reader's share of it is restacked, the whole state (a resume's) refused in one line.
    per_site = {"components": {"sites": {s: {"V": c.V, "U": c.U}
                                         for s, c in run.components.sites.items()}},
                "ci_fn": eqx.filter(run.ci_fn, eqx.is_array)}
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    ckpt.save(300, per_site)
    ckpt.close()
    older = api.load_run(tmp_path / "run", whole_state=False)
    assert older.step == 300 and older.state is None
    for a, b in zip(jax.tree.leaves((run.components, run.ci_fn)),
                    jax.tree.leaves((older.components, older.ci_fn)), strict=True):
        assert jnp.array_equal(a, b)
    with pytest.raises(api.RunDirError, match="at step 300 holds components per site.*a "
                                              "resume needs the pdecomp that wrote it"):
        api.load_run(tmp_path / "run")


@pytest.mark.parametrize("overrides", [["model=nope"], ["layers.C=-1"], ["nokey=3"],
                                       ["layers.C=abc"], ["optim.steps=[1"]])
def test_compose_fails_with_the_clis_line(overrides: list[str], env: dict[str, str],
                                          tmp_path: Path) -> None:
    with pytest.raises(api.ConfigError) as e:
        api.compose(overrides)
    cli = pdecomp(overrides, tmp_path, env)
    assert cli.returncode == 2 and cli.stderr.strip() == str(e.value)
    assert not any(tmp_path.iterdir())


def test_compose_refuses_a_sweep() -> None:
    with pytest.raises(api.ConfigError, match="optim.steps='1,2'.*one run"):
        api.compose(["optim.steps=1,2"])


def test_load_run_names_what_is_missing(cache, tmp_path: Path) -> None:
    with pytest.raises(api.RunDirError, match=f"{tmp_path / 'nowhere'}: not a pdecomp run "
                                              r"directory \(does not exist\)"):
        api.load_run(tmp_path / "nowhere")
    with pytest.raises(api.RunDirError, match=f"{tmp_path}: not a pdecomp run directory "
                                              r"\(has no config.yaml\)"):
        api.load_run(tmp_path)

    gate_only = tmp_path / "gate"
    api.run(api.compose(["gate.only=true"]), gate_only, QUIET)
    with pytest.raises(api.RunDirError, match=f"{gate_only}: no checkpoints/"):
        api.load_run(gate_only)
    assert not (gate_only / "checkpoints").exists()  # looking made nothing


@pytest.mark.parametrize("preset", ["tms_5-2", "resid_mlp1", "llama_tiny_chunkwise"])
def test_a_run_directory_written_before_the_per_kind_schemas_reads_back(preset, tmp_path):
    """Older run directories hold every kind's model fields in one flat mapping (the flat
    schema's, with its defaults); they open as the config they were written from."""
    import dataclasses
    import json

    import yaml

    from pdecomp.run.load import read_config

    cfg = api.compose([], preset=preset)
    flat = {"name": "tms_5-2", "kind": "tms", "path": "", "n_features": 5, "d_hidden": 2,
            "d_embed": 1000, "n_layers": 1, "vocab_size": 128, "d_mlp": 160, "n_heads": 4,
            "n_kv_heads": 4, "head_dim": 0, "rope_theta": 10000.0, "rope_scaling": {},
            "rms_norm_eps": 1e-5, "tie_embeddings": False, "attn_bias": [],
            "sliding_window": 0, "n_hidden_layers": 0, "feature_prob": 0.05,
            "train_steps": 10000, "train_batch_size": 1024, "train_lr": 0.005, "seed": 0,
            "max_retrain": 3, "cache_dir": ""}
    old = json.loads(json.dumps(dataclasses.asdict(cfg)))  # plain, as rundir.write_config writes
    old["model"] = {**flat, **old["model"]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert read_config(tmp_path) == cfg


def test_no_final_evaluation_with_zero_eval_batches(cache, tmp_path: Path) -> None:
    """`data.eval_batches=0`: trained and checkpointed, then no evaluation: the summary holds
    the last losses and the steps, no metric of the final evaluation and no plot."""
    cfg = api.compose(["+experiment=tms_5-2", "optim.steps=20", "logging.log_every=10",
                       "data.eval_batches=0"])
    summary = api.run(cfg, tmp_path / "run", QUIET)
    assert summary["steps"] == 20 and "loss/total" in summary
    assert not any(k.startswith(("live/", "l0/", "mmcs", "plots/")) for k in summary)
    assert not list((tmp_path / "run").glob("*.png"))
    assert api.load_run(tmp_path / "run").step == 20

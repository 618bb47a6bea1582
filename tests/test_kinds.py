"""Model kinds: the core asks the run's kind instead of switching on its name, so a new kind
is one module and one registry entry."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jaxtyping import Array

from launcher import api
from pdecomp import kinds
from pdecomp.core import sharding
from pdecomp.core.config import ConfigError, ModelConfig, TMSConfig
from pdecomp.core.memory import PLAIN, MemoryPolicy
from pdecomp.kinds import site_C
from pdecomp.kinds.toy import ToyKind
from pdecomp.plan.validation import validate
from pdecomp.run.decompose import Hooks
from pdecomp.spd.components import LinearFn, frozen_linear

ROOT = Path(__file__).resolve().parents[1]
# The modules of the kinds themselves (and the registry); everything else is the core,
# kinds/cache.py (the trained-target cache) included: it asks the kind to make, train and
# check a target.
PER_KIND = {"pdecomp/kinds/__init__.py", "pdecomp/kinds/toy.py", "pdecomp/kinds/language_model.py",
            "pdecomp/targets/toy_models.py", "pdecomp/targets/llama.py",
            "pdecomp/targets/hf_checkpoint.py"}
SWITCH = re.compile(r"\.kind\s*(==|!=|\bin\b|\bnot in\b)|model\.kind\]|"
                    r"isinstance\([^)]*\b(TMS|ResidMLP|Llama)\b|tokens_per_example\([^)]*\)\s*>")


def test_the_core_asks_the_kind_instead_of_switching_on_it():
    hits = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
            for folder in ("pdecomp", "launcher") for path in sorted((ROOT / folder).rglob("*.py"))
            if str(path.relative_to(ROOT)) not in PER_KIND
            for i, line in enumerate(path.read_text().splitlines(), 1) if SWITCH.search(line)]
    # the one left: analyze's page shows token contexts or feature inputs, by what the
    # kind's examples are (a capability asked of the kind, not its name)
    assert len(hits) <= 1, "\n".join(hits)


def test_every_registered_kind_resolves_and_an_unknown_one_is_refused():
    for name in kinds.KINDS:
        kind = kinds.kind_of(ModelConfig(kind=name))
        assert isinstance(kind, kinds.Kind)
    with pytest.raises(ConfigError, match=r"model.kind='gpt2'.*allowed: tms, resid_mlp, llama"):
        kinds.kind_of(ModelConfig(kind="gpt2"))


class Linear(eqx.Module):
    """A one-site model the core has never heard of: y = ReLU(x W)."""

    W: Array

    def __call__(self, x: Array, linear: LinearFn = frozen_linear) -> Array:
        return jax.nn.relu(linear("proj", x, self.W))

    def site_weights(self) -> dict[str, Array]:
        return {"proj": self.W}

    def split(self, sites: Sequence[str], memory: MemoryPolicy = PLAIN
              ) -> tuple[Callable, Callable]:
        return (lambda x: x.astype(memory.dtype)), lambda x, linear, streams=None, live=None: (
            self(x, linear))


class LinearKind(ToyKind):
    """Feature batches as the toys draw them; random weights, no training, no ground truth."""

    schema = TMSConfig  # its fields: n_features, d_hidden (and unused ones)

    def site_names(self, model: ModelConfig) -> tuple[str, ...]:
        return ("proj",)

    def init_target(self, key: Array, model: ModelConfig, dtype: Any) -> Linear:
        n, m = model.n_features, model.d_hidden
        return Linear(jax.random.normal(key, (n, m), dtype) / jnp.sqrt(n))

    def load(self, model: ModelConfig, layers: Any, target_dtype: Any, shardings: Any,
             log: Callable[[str], None]):
        target = self.init_target(jax.random.PRNGKey(model.seed), model, jnp.float32)
        return sharding.put_from_host(target, shardings), {"seed": model.seed}


def test_a_new_kind_is_one_module_and_one_registry_entry(monkeypatch, tmp_path: Path):
    # The whole of "adding a kind": its module (above) and its entry in the registry.
    monkeypatch.setitem(kinds.KINDS, "linear", f"{__name__}:LINEAR_KIND")
    cfg = api.compose(["+experiment=tms_5-2", "model.kind=linear", "model.name=linear_5-8",
                       "model.d_hidden=8", "layers.sites=[proj]", "optim.steps=60",
                       "logging.plots=false", "logging.log_every=30"])
    assert site_C(cfg.model, cfg.layers) == {"proj": cfg.layers.C}
    summary = api.run(cfg, tmp_path / "run", Hooks(log=lambda _: None))
    assert summary["steps"] == 60 and "live/proj" in summary and "l0/proj" in summary
    assert "mmcs/proj" not in summary  # no ground truth: the kind's evaluate adds nothing
    # its name is now allowed, and the rules a kind declares are applied to it
    bad = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, distance="kl"))
    with pytest.raises(ConfigError, match=r"loss.distance='kl'.*compared by mse"):
        validate(bad)


LINEAR_KIND = LinearKind()

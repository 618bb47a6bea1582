"""Each method choice is declared once, in a registry beside its implementation (name ->
implementation); the allowed names and the refusal derive from it."""

from __future__ import annotations

import ast
import dataclasses as dc
from pathlib import Path

import pytest

from pdecomp.core import hardware, memory
from pdecomp.core.config import ConfigError, RunConfig
from pdecomp.plan.validation import validate
from pdecomp.spd import adversary, ci, losses, masks
from pdecomp.spd import step as train

pytestmark = pytest.mark.jax_versions  # every option composes and validates under each version

SCHEMA_AND_CHECKS = [Path(__file__).resolve().parents[1] / "pdecomp" / f"{m}.py"
                     for m in ("core/config", "plan/validation")]


def _at(node, key: str, value):
    """`node` (a config, or a dict of them such as loss.recon) with the dotted `key` set."""
    head, _, rest = key.partition(".")
    new = _at(node[head] if isinstance(node, dict) else getattr(node, head), rest, value) \
        if rest else value
    return {**node, head: new} if isinstance(node, dict) else dc.replace(node, **{head: new})


def _llama() -> RunConfig:
    from test_lm import tiny_cfg

    return tiny_cfg()


# (registry, config key, the config to set it in): every choice the method dispatches on.
CHOICES = [
    (masks.PLANS, "loss.recon.chunkwise.plan", _llama),
    (masks.SOURCES, "loss.recon.chunkwise.source", _llama),
    (masks.ROUTINGS, "loss.recon.chunkwise.routing", _llama),
    (losses.DISTANCES, "loss.distance", None),
    (memory.REMAT, "memory.remat", RunConfig),
    (memory.SITE_LAYER_SAVES, "memory.site_layer_saves", RunConfig),
    (train.SCHEDULES, "optim.components.schedule", RunConfig),
    (masks.PGD_SCOPES, "loss.pgd.scope", _llama),
    (masks.PGD_SCOPES, "loss.eval_pgd.scope", _llama),
    (adversary.PGD_OPTIMIZERS, "loss.pgd.optimizer", _llama),
    (train.TIE_UPDATES, "layers.tie_update", RunConfig),
    (ci.CI_FNS, "layers.ci_fn", RunConfig),
]


@pytest.mark.parametrize(("registry", "key", "base"), CHOICES, ids=[c[1] for c in CHOICES])
def test_every_registered_name_validates_and_others_are_refused_by_the_registry(
        registry, key, base):
    """Each name in the registry is a valid value of its key (the distance's valid names
    depend on the model: kl for a language model, mse for a toy), and anything else is
    refused with the registry's names, in its order."""
    for name in registry:
        if base is None:
            cfg = _llama() if name == "kl" else RunConfig()
        else:
            cfg = base()
        validate(_at(cfg, key, name))
    cfg = RunConfig() if base is None else base()
    with pytest.raises(ConfigError) as e:
        validate(_at(cfg, key, "nonesuch"))
    assert e.value.key == key and f"allowed: {', '.join(registry)}" in str(e.value), str(e.value)


def test_gate_targets_are_local_and_the_hardware_table():
    for name in ("local", *hardware.GPUS):
        validate(dc.replace(RunConfig(), gate=dc.replace(RunConfig().gate, target=name,
                                                         only=name != "local")))
    with pytest.raises(ConfigError, match=f"allowed: local, {', '.join(hardware.GPUS)}"):
        validate(dc.replace(RunConfig(), gate=dc.replace(RunConfig().gate, target="a100")))


def test_the_schema_and_its_checks_spell_no_registered_name_in_a_tuple_of_choices():
    """config.py and validation.py declare no tuple of allowed names for a choice a registry
    holds (a default value names one choice; a tuple of them would be the second
    declaration)."""
    registries = [set(r) for r, _, _ in CHOICES] + [set(hardware.GPUS)]
    for path in SCHEMA_AND_CHECKS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                assert all(len(names & r) < 2 for r in registries), ast.unparse(node)


def test_site_patterns_expand_in_the_targets_order():
    """`layers.sites` patterns: a range A-B and `*` per dotted part, a prefix stands for the
    sites under it, each in the target's fixed order; no match or a backwards range is a
    ConfigError naming the entry."""
    from launcher.api import compose
    from pdecomp.core.config import expand_sites

    known = tuple(f"layers.{i}.{p}.{w}" for i in range(4) for p, ws in
                  (("self_attn", ("q_proj", "o_proj")), ("mlp", ("gate_proj", "down_proj")))
                  for w in ws)
    assert expand_sites(["layers.1-2.mlp"], known) == (
        "layers.1.mlp.gate_proj", "layers.1.mlp.down_proj",
        "layers.2.mlp.gate_proj", "layers.2.mlp.down_proj")
    assert expand_sites(["layers.*.mlp.down_proj", "layers.0.self_attn.q_proj"], known) == (
        *(f"layers.{i}.mlp.down_proj" for i in range(4)), "layers.0.self_attn.q_proj")
    assert expand_sites(["layers.3"], known) == known[-4:]
    for bad in ("layers.2-1.mlp", "layers.4.mlp", "layers.1-x.mlp", "mlp"):
        with pytest.raises(ConfigError, match="layers.sites"):
            expand_sites([bad], known)
    # The 8B's 96 MLP matrices without typing them; the config records the sites themselves.
    cfg = compose(["+experiment=llama8b_l18-26_chunkwise", "layers.sites=[layers.0-31.mlp]",
                   "loss.recon.chunkwise.sites_per_chunk=32", "data.source=synthetic"])
    assert len(cfg.layers.sites) == 96 and tuple(cfg.layers.sites[:2]) == (
        "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj")


def test_C_per_site_keys_are_sites_patterns_or_a_matrix_name():
    """`layers.C_per_site`: a matrix's name sets it in every layer, a pattern its sites, a
    later key wins; a key naming no decomposed site is left for the validation to refuse.
    The whole-8B preset: the recipe's C per matrix over its 224 sites."""
    from launcher.api import compose
    from pdecomp.core.config import expand_C
    from pdecomp.kinds import site_C

    sites = [f"layers.{i}.{w}" for i in range(2) for w in ("self_attn.k_proj", "mlp.up_proj")]
    assert expand_C({"k_proj": 8, "layers.1.mlp": 5, "layers.1.self_attn.k_proj": 3}, sites) == {
        "layers.0.self_attn.k_proj": 8, "layers.1.self_attn.k_proj": 3, "layers.1.mlp.up_proj": 5}
    assert expand_C({"q_proj": 8}, sites) == {"q_proj": 8}
    with pytest.raises(ConfigError, match="layers.C_per_site.q_proj"):
        compose(["+experiment=llama_tiny_chunkwise", "+layers.C_per_site.q_proj=8"])
    cfg = compose(["+experiment=llama8b_all", "data.source=synthetic"])
    C = site_C(cfg.model, cfg.layers)
    assert len(C) == 224 and sum(C.values()) == 32 * (2 * 4096 + 2 * 1024 + 3 * 14336)
    assert C["layers.7.self_attn.k_proj"] == 1024 and C["layers.31.mlp.down_proj"] == 14336

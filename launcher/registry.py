"""The config registry: pdecomp's frozen schema, registered in Hydra's ConfigStore.

OmegaConf treats a frozen dataclass as read-only and refuses to merge YAML into it, so the
registry stores a mutable twin of each schema class (same fields, types and defaults); the
composed config is turned back into the frozen `RunConfig` by `to_run_config`.
"""

from __future__ import annotations

import dataclasses
import typing
from functools import cache
from pathlib import PurePath
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from pdecomp.core.config import (
    ConfigError,
    ModelConfig,
    RunConfig,
    expand_C,
    expand_sites,
)
from pdecomp.kinds import KINDS, kind_of, run_config, site_names_of
from pdecomp.targets.hub import local_model_dir


@cache
def mutable_twin(cls: type) -> type:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if hints[f.name] is ModelConfig:  # typed by the chosen model/ option's schema
            specs.append((f.name, Any, dataclasses.field(default=MISSING)))
            continue
        tp = _twin_type(hints[f.name])
        if f.default is not dataclasses.MISSING:
            specs.append((f.name, tp, dataclasses.field(default=f.default)))
        else:
            factory = f.default_factory
            specs.append((f.name, tp, dataclasses.field(
                default_factory=lambda factory=factory: _twin_value(factory()))))
    return dataclasses.make_dataclass(cls.__name__, specs)


def _twin_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return mutable_twin(tp)
    if origin is dict:
        k, v = typing.get_args(tp)
        # OmegaConf 2.3 cannot assign a new entry to a Dict[str, Dataclass] from the command
        # line (`+loss.recon.chunks={...}`), so such dicts are untyped here; `from_dict`
        # types and checks their entries.
        return dict[k, Any] if dataclasses.is_dataclass(v) else dict[k, _twin_type(v)]
    if origin is list:
        (v,) = typing.get_args(tp)
        return list[_twin_type(v)]
    return tp


def _twin_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        twin = mutable_twin(type(value))
        return twin(**{f.name: _twin_value(getattr(value, f.name))
                       for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        if any(dataclasses.is_dataclass(v) for v in value.values()):
            # A named collection (loss.recon): Hydra merges a group's dict into the schema
            # default instead of replacing it, so the schema starts it empty and each
            # group option lists its entries in full.
            return {}
        return {k: _twin_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_twin_value(v) for v in value]
    return value


def register() -> None:
    """Store the run schema as `run_schema` (config.yaml lists it first in its defaults),
    each model kind's schema as `schema/model/<kind>` (a `model/` option lists its kind's
    first in its defaults), and the resolvers the configs use."""
    store = ConfigStore.instance()
    store.store(name="run_schema", node=mutable_twin(RunConfig))
    for name in KINDS:
        store.store(group="schema/model", name=name, node=mutable_twin(kind_of(name).schema))
    OmegaConf.register_new_resolver("pdecomp.model_name", model_name, replace=True)


def model_name(path: str, preset: str) -> str:
    """`${pdecomp.model_name:${.path},<preset>}`: a model loaded from a directory is named
    after it (and so are its run directory and messages), else after its preset. In a
    Hugging Face cache (`models--<org>--<name>/snapshots/<hash>`) the name is the model's."""
    if not path:
        return preset
    p = PurePath(str(path))
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.split("--")[-1]
    if p.name.startswith("models--"):  # the cache's folder of one repository
        return p.name.split("--")[-1]
    return p.name.split("@")[0] or preset  # a hub id's name, without its revision


def to_run_config(cfg: DictConfig | dict[str, Any]) -> RunConfig:
    """The frozen RunConfig of a composed config (or of its resolved plain-dict form)."""
    data = (OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
            if isinstance(cfg, DictConfig) else cfg)
    assert isinstance(data, dict)
    cfg = run_config({k: v for k, v in data.items() if k != "hydra"})
    if path := getattr(cfg.model, "path", ""):  # a hub id: its snapshot in the hub cache
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, path=local_model_dir(path)))
    try:
        known = site_names_of(cfg.model)
    except ConfigError:  # a bad model: validation names it first, sites unexpanded
        return cfg
    sites = type(cfg.layers.sites)(expand_sites(cfg.layers.sites, known))  # as from_dict has it
    return dataclasses.replace(cfg, layers=dataclasses.replace(
        cfg.layers, sites=sites, C_per_site=expand_C(cfg.layers.C_per_site, sites)))

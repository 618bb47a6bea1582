"""What a model kind owns: its sites, its batches, how its target is checked, loaded and
evaluated.

The core (config, run, train, the launcher) asks the run's kind, `kind_of(cfg.model)`,
instead of switching on `model.kind`. A new kind is one module with a `Kind` subclass and
one entry in `KINDS` (name -> where it lives, imported when first asked for); `model.kind`
then allows its name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding
from jaxtyping import Array

from pdecomp.core.config import (
    ConfigError,
    DataConfig,
    DataSource,
    DType,
    EvalPGDConfig,
    LayersConfig,
    ModelConfig,
    RunConfig,
    check_positive,
    from_dict,
)

# name -> "module:attribute" of its Kind instance
KINDS: dict[str, str] = {
    "tms": "pdecomp.kinds.toy:TMS_KIND",
    "resid_mlp": "pdecomp.kinds.toy:RESID_MLP_KIND",
    "llama": "pdecomp.kinds.language_model:LLAMA_KIND",
}


@dataclass(frozen=True)
class EvalSpec:
    """What a kind's final metrics read of the run, resolved by the run once."""

    ci_threshold: float  # loss.ci_threshold: a component is live above it
    delta: bool  # layers.delta: the masked forwards run the weight delta
    compute_dtype: DType  # memory.compute_dtype
    logits_chunk: int  # memory.logits_chunk: positions per chunk of the KL and CE
    pgd: EvalPGDConfig  # loss.eval_pgd: the adversarial evaluation


class Kind:
    """One model kind's answers. Subclasses set the class attributes and implement the
    methods that raise NotImplementedError; the others have the common answer."""

    # its config's fields (a ModelConfig subclass); the schema of its `model/` options
    schema: type[ModelConfig] = ModelConfig
    # the output distance its recon terms compare with (a name in losses.DISTANCES), and
    # why another is refused
    distance: str = "mse"
    distance_why: str = "it outputs vectors"
    # what `data.source` it reads
    data_sources: tuple[str, ...] = (DataSource.toy,)
    # the model's fields that must be > 0 (0 allowed for those in `zero_ok`)
    positive: tuple[str, ...] = ()
    zero_ok: tuple[str, ...] = ()

    def site_names(self, model: ModelConfig) -> tuple[str, ...]:
        """The target's sites in their fixed, documented order."""
        raise NotImplementedError

    def validate(self, model: ModelConfig) -> None:
        """Checks of `model.*` that types cannot express (ConfigError)."""
        for key in self.positive:
            check_positive(f"model.{key}", getattr(model, key), zero_ok=key in self.zero_ok)

    def validate_data(self, model: ModelConfig, data: DataConfig, seed: int,
                      scan: bool = True) -> None:
        """Checks of the data a training run reads, before anything is made (ConfigError;
        not asked of a gate-only run, which reads no data). Without `scan`, only what
        headers and sizes tell (a submission's check; the job scans)."""

    def preflight(self, model: ModelConfig, data: DataConfig, seed: int) -> None:
        """Checks that read files a training job needs (the token stream), in the job."""

    def tied_sites(self, model: ModelConfig, layers: LayersConfig) -> dict[str, str]:
        """follower -> leader for the decomposed sites whose weights the target ties."""
        return {}

    def init_target(self, key: Array, model: ModelConfig, dtype: Any) -> Any:
        """A target of the right shapes with fresh weights (the gate's abstract target)."""
        raise NotImplementedError

    def train_target(self, model: ModelConfig, seed: int,
                     on_progress: Callable[[int, float], None] | None) -> Any:
        """Its target trained from `seed` (pdecomp.kinds.cache caches it by its settings)."""
        raise NotImplementedError

    def check_target(self, target: Any, model: ModelConfig) -> dict[str, Any]:
        """Did training give a target worth decomposing? `ok` says; `problem` says why not
        (a target that fails is trained again from the next seed)."""
        raise NotImplementedError

    def trained_means(self, model: ModelConfig) -> str:
        """What a trained target that passes `check_target` does, for a refusal's line."""
        return "passes its check"

    def positions(self, data: DataConfig, batch_size: int) -> tuple[int, ...]:
        """The leading (position) shape of a batch's site inputs."""
        return (batch_size,)

    def tokens_per_example(self, data: DataConfig) -> int:
        """Tokens in one example (0: its inputs are not tokens)."""
        return 0

    def batch_abstract(self, model: ModelConfig, data: DataConfig, batch_size: int,
                       sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        """One batch as a shape, split by `sharding`."""
        raise NotImplementedError

    def batch_sampler(self, model: ModelConfig, data: DataConfig, seed: int,
                      sharding: NamedSharding, key: Array, held_out: bool = False
                      ) -> Callable[[int], Array]:
        """step -> that step's global batch of `data.batch_size`, already split by
        `sharding`; deterministic in (seed or key, step), so a resumed run sees the batches
        an uninterrupted one saw."""
        raise NotImplementedError

    def load(self, model: ModelConfig, layers: LayersConfig, target_dtype: DType,
             shardings: Any, log: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
        """The frozen target stored in `target_dtype`, in `shardings`, and what says where
        it came from (`layers`: what the run decomposes of it, for the log)."""
        raise NotImplementedError

    def for_evaluation(self, trees: Any, replicated: NamedSharding) -> Any:
        """The target, components and CI function as `evaluate` reads them."""
        return trees

    def evaluate(self, model: ModelConfig, spec: EvalSpec, target: Any, components: Any,
                 ci_fn: Any, batches: list[Array], key: Array, ci: dict[str, dict[str, Any]]
                 ) -> dict[str, Any]:
        """The kind's own final metrics (besides every kind's live/L0 per site): numbers."""
        return {}

    def eval_program(self, spec: EvalSpec, sites: tuple[str, ...]) -> Callable | None:
        """The device program `evaluate` runs on each held-out batch, (target, components,
        ci_fn, batch, key) -> scalars, for the gate to compile beside the step; None where
        the kind's metrics are read on the host."""
        return None

    def direct_logits(self, target: Any, site: str, U: Array) -> Array | None:
        """Language models: the next-token logits one unit of each component's output at
        `site` adds by the direct path to the unembedding ([C, vocab]); None where no fixed
        linear path leads there (or the kind has no vocabulary)."""
        return None

    def plots(self, target: Any, components: Any, ci: dict[str, dict[str, Any]], thr: float,
              run_dir: Any) -> dict[str, str]:
        """The kind's own plots of the result: summary key -> file drawn."""
        return {}


_resolved: dict[str, Kind] = {}


def kind_of(model: ModelConfig | str) -> Kind:
    """The Kind of `model` (or of that kind name); ConfigError naming the allowed kinds for
    an unknown one."""
    name = model if isinstance(model, str) else model.kind
    if name not in _resolved:
        if name not in KINDS:
            raise ConfigError("model.kind", name, f"allowed: {', '.join(KINDS)}")
        module, attr = KINDS[name].split(":")
        _resolved[name] = getattr(importlib.import_module(module), attr)
    return _resolved[name]


def run_config(data: dict[str, Any]) -> RunConfig:
    """A RunConfig from plain nested dicts, its model read with its kind's schema."""
    return from_dict(RunConfig, data, schema_of=lambda kind: kind_of(kind).schema)


def site_names_of(model: ModelConfig) -> tuple[str, ...]:
    """The target's sites in their fixed, documented order (its kind's `site_names`)."""
    return kind_of(model).site_names(model)


def tied_sites(model: ModelConfig, layers: LayersConfig) -> dict[str, str]:
    """follower -> leader for the decomposed sites whose weights the target ties."""
    return kind_of(model).tied_sites(model, layers)


def site_C(model: ModelConfig, layers: LayersConfig) -> dict[str, int]:
    """Components per decomposed site, in the target's canonical site order: `layers.C`, or
    `layers.C_per_dim` times the site matrix's largest dimension; `C_per_site` over both."""
    chosen = [s for s in site_names_of(model) if s in set(layers.sites)]
    if layers.C_per_dim:
        dims = site_dims(model)
        C = {s: max(1, round(layers.C_per_dim * max(dims[s]))) for s in chosen}
    else:
        C = dict.fromkeys(chosen, layers.C)
    return {s: layers.C_per_site.get(s, c) for s, c in C.items()}


def site_dims(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each site's weight shape [d_in, d_out], from the target's shapes alone (no weights)."""
    import jax.numpy as jnp

    weights = jax.eval_shape(lambda: kind_of(model).init_target(
        jax.random.PRNGKey(0), model, jnp.float32).site_weights())
    return {s: tuple(W.shape) for s, W in weights.items()}

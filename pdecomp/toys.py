"""The toy kinds: TMS and the residual MLP, trained in-process on sparse features, whose
ground truth (one component per feature) the final metrics compare against."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array

from pdecomp import metrics, plots, sharding, targets
from pdecomp.config import ConfigError, ModelConfig, ResidMLPConfig, RunConfig, TMSConfig
from pdecomp.kinds import Kind


class ToyKind(Kind):
    """What TMS and the residual MLP share: feature batches drawn from a key, a target
    trained and cached by its settings, metrics read on the host."""

    positive = ("n_features", "d_hidden", "train_steps", "train_batch_size", "train_lr")

    def validate(self, model: ModelConfig) -> None:
        super().validate(model)
        if not 0.0 < model.feature_prob <= 1.0:
            raise ConfigError("model.feature_prob", model.feature_prob, "must be in (0, 1]")

    def init_target(self, key: Array, model: ModelConfig, dtype: Any) -> Any:
        return targets.init_target(key, model, dtype)

    def batch_abstract(self, cfg: RunConfig, batch_size: int, sharding: NamedSharding
                       ) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((batch_size, cfg.model.n_features), jnp.float32,
                                    sharding=sharding)

    def batch_sampler(self, cfg: RunConfig, sharding: NamedSharding, key: Array,
                      held_out: bool = False) -> Callable[[int], Array]:
        del held_out  # fresh draws from another key are held out already
        B = cfg.data.batch_size
        # fold_in inside the jit: one dispatch a step, not two (the host thread shares the
        # cores with the step on a CPU)
        sample = jax.jit(lambda k, i: targets.sample_inputs(jax.random.fold_in(k, i),
                                                            cfg.model, B),
                         out_shardings=sharding)
        return lambda i: sample(key, i)

    def load(self, cfg: RunConfig, shardings: Any, log: Callable[[str], None]
             ) -> tuple[Any, dict[str, Any]]:
        target, meta = targets.load_shared_target(cfg.model, log)
        return sharding.put_from_host(target, shardings), meta

    def for_evaluation(self, trees: Any, replicated: NamedSharding) -> Any:
        # The ground-truth metrics read weights and CI on the host: every process needs its
        # whole copy (they are tiny), also when the state is split across processes (FSDP).
        return jax.jit(lambda t: t, out_shardings=replicated)(trees)


class TMSKind(ToyKind):
    schema = TMSConfig
    positive = (*ToyKind.positive, "n_hidden_layers")
    zero_ok = ("n_hidden_layers",)

    def site_names(self, model: ModelConfig) -> tuple[str, ...]:
        hidden = tuple("hidden" if model.n_hidden_layers == 1 else f"hidden.{i}"
                       for i in range(model.n_hidden_layers))
        return ("linear1", *hidden, "linear2")

    def tied_sites(self, cfg: RunConfig) -> dict[str, str]:
        # linear2 computes with W's transpose: its components are linear1's, transposed
        chosen = set(cfg.layers.sites)
        return ({"linear2": "linear1"} if cfg.layers.tie and {"linear1", "linear2"} <= chosen
                else {})

    def evaluate(self, cfg: RunConfig, target: Any, components: Any, ci_fn: Any,
                 batches: list[Array], key: Array, ci: dict[str, dict[str, Any]]
                 ) -> dict[str, Any]:
        thr = cfg.loss.ci_threshold
        return {**metrics.tms_ground_truth(target, components,
                                           {s: v["max_ci"] > thr for s, v in ci.items()}),
                **metrics.one_hot_live(target, components, ci_fn, thr, cfg.model.n_features)}

    def plots(self, target: Any, components: Any, ci: dict[str, dict[str, Any]], thr: float,
              run_dir: Path) -> dict[str, str]:
        if target.W.shape[1] != 2 or "linear1" not in components.sites:
            return {}  # the directions are drawn in a 2-d hidden space only
        comp = components.sites["linear1"]
        V, U = np.asarray(comp.V), np.asarray(comp.U)
        scale = V[np.abs(V).argmax(0), np.arange(V.shape[1])]
        return {"plots/tms_directions": str(plots.plot_tms_directions(
            np.asarray(target.W), U * scale[:, None], ci["linear1"]["max_ci"] > thr,
            run_dir / "tms_directions.png"))}


class ResidMLPKind(ToyKind):
    schema = ResidMLPConfig
    positive = (*ToyKind.positive, "d_embed", "n_layers")

    def site_names(self, model: ModelConfig) -> tuple[str, ...]:
        return tuple(f"layers.{i}.{w}" for i in range(model.n_layers)
                     for w in ("mlp_in", "mlp_out"))

    def evaluate(self, cfg: RunConfig, target: Any, components: Any, ci_fn: Any,
                 batches: list[Array], key: Array, ci: dict[str, dict[str, Any]]
                 ) -> dict[str, Any]:
        return metrics.resid_one_to_one(target, components, ci_fn, cfg.loss.ci_threshold)


TMS_KIND = TMSKind()
RESID_MLP_KIND = ResidMLPKind()

"""The toy kinds: TMS and the residual MLP (their modules in pdecomp.toy_models), trained
in-process on sparse features, whose ground truth (one component per feature) the final
metrics compare against."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jaxtyping import Array, PRNGKeyArray

from pdecomp import metrics, plots, sharding, targets, toy_models
from pdecomp.config import (
    ConfigError,
    DataConfig,
    DType,
    LayersConfig,
    ModelConfig,
    ResidMLPConfig,
    TMSConfig,
)
from pdecomp.kinds import EvalSpec, Kind, kind_of

_TRAIN_CHUNK = 500  # steps per compiled scan of a toy's training


def sample_inputs(key: PRNGKeyArray, model: ModelConfig, batch_size: int) -> Array:
    """A batch of a toy's sparse features, as its kind draws them."""
    return kind_of(model).sample_inputs(key, model, batch_size)


class ToyKind(Kind):
    """What TMS and the residual MLP share: feature batches drawn from a key, a target
    trained and cached by its settings, metrics read on the host."""

    positive = ("n_features", "d_hidden", "train_steps", "train_batch_size", "train_lr")

    def validate(self, model: ModelConfig) -> None:
        super().validate(model)
        if not 0.0 < model.feature_prob <= 1.0:
            raise ConfigError("model.feature_prob", model.feature_prob, "must be in (0, 1]")

    feature_low = 0.0  # an active feature's value is U[feature_low, 1]

    def labels(self, x: Array) -> Array:
        """What the target is trained to output for features x."""
        raise NotImplementedError

    def trainable(self, target: Any) -> Any:
        """The filter spec of the weights its training updates (False: left as made)."""
        return jax.tree.map(lambda _: True, target)

    def sample_inputs(self, key: PRNGKeyArray, model: ModelConfig, batch_size: int) -> Array:
        return toy_models.sample_features(key, model.n_features, model.feature_prob,
                                          batch_size, self.feature_low)

    def train_target(self, model: ModelConfig, seed: int,
                     on_progress: Callable[[int, float], None] | None) -> Any:
        """Adam on MSE against `labels`, fresh features every step."""
        init_key, data_key = jax.random.split(jax.random.PRNGKey(seed))
        target = self.init_target(init_key, model, jnp.float32)
        params, static = eqx.partition(target, self.trainable(target))

        def loss_fn(params, key):
            x = self.sample_inputs(key, model, model.train_batch_size)
            return jnp.mean((eqx.combine(params, static)(x) - self.labels(x)) ** 2)

        keys = jax.random.split(data_key, model.train_steps)
        chunks = ((min(s + _TRAIN_CHUNK, model.train_steps), keys[s:s + _TRAIN_CHUNK])
                  for s in range(0, model.train_steps, _TRAIN_CHUNK))
        return eqx.combine(targets.fit(params, loss_fn, optax.adam(model.train_lr), chunks,
                                       on_progress), static)

    def check_target(self, target: Any, model: ModelConfig) -> dict[str, Any]:
        """Does the target represent every feature? The decomposition's ground truth needs
        it."""
        score, threshold = self.feature_scores(target, model)
        missing = [int(i) for i in np.flatnonzero(score < threshold)]
        problem = (f"misses features {missing} (scores below {threshold}; median "
                   f"{float(np.median(score)):.3f})") if missing else ""
        return {"n_features": model.n_features, "missing": missing, "threshold": threshold,
                "min_score": float(score.min()), "median_score": float(np.median(score)),
                "ok": not missing, "problem": problem}

    def feature_scores(self, target: Any, model: ModelConfig) -> tuple[np.ndarray, float]:
        """How well each feature is represented, and the score below which it is missing."""
        raise NotImplementedError

    def trained_means(self, model: ModelConfig) -> str:
        return f"represents all {model.n_features} features"

    def batch_abstract(self, model: ModelConfig, data: DataConfig, batch_size: int,
                       sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((batch_size, model.n_features), jnp.float32,
                                    sharding=sharding)

    def batch_sampler(self, model: ModelConfig, data: DataConfig, seed: int,
                      sharding: NamedSharding, key: Array, held_out: bool = False
                      ) -> Callable[[int], Array]:
        del seed, held_out  # drawn from `key`; fresh draws from another key are held out
        B = data.batch_size
        # fold_in inside the jit: one dispatch a step, not two (the host thread shares the
        # cores with the step on a CPU)
        sample = jax.jit(lambda k, i: self.sample_inputs(jax.random.fold_in(k, i), model, B),
                         out_shardings=sharding)
        return lambda i: sample(key, i)

    def load(self, model: ModelConfig, layers: LayersConfig, target_dtype: DType,
             shardings: Any, log: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
        del layers, target_dtype  # a toy is kept in float32 whole (it is tiny)
        target, meta = targets.load_shared_target(model, log)
        return sharding.put_from_host(target, shardings), meta

    def for_evaluation(self, trees: Any, replicated: NamedSharding) -> Any:
        # The ground-truth metrics read weights and CI on the host: every process needs its
        # whole copy (they are tiny), also when the state is split across processes (FSDP).
        return jax.jit(lambda t: t, out_shardings=replicated)(trees)


class TMSKind(ToyKind):
    schema = TMSConfig
    positive = (*ToyKind.positive, "n_hidden_layers")
    zero_ok = ("n_hidden_layers",)

    def init_target(self, key: Array, model: ModelConfig, dtype: Any) -> Any:
        return toy_models.init_tms(key, model.n_features, model.d_hidden,
                                   model.n_hidden_layers)

    def labels(self, x: Array) -> Array:
        return x  # an autoencoder of its features

    def feature_scores(self, target: Any, model: ModelConfig) -> tuple[np.ndarray, float]:
        # a represented feature's embedding row has norm ~1, a dropped one's collapses to ~0
        return np.asarray(jnp.linalg.norm(target.W, axis=-1)), 0.5

    def trainable(self, target: Any) -> Any:
        # the hidden identity layers of the +ID variants stay identities
        return eqx.tree_at(lambda t: t.hidden, super().trainable(target),
                           [False] * len(target.hidden))

    def site_names(self, model: ModelConfig) -> tuple[str, ...]:
        hidden = tuple("hidden" if model.n_hidden_layers == 1 else f"hidden.{i}"
                       for i in range(model.n_hidden_layers))
        return ("linear1", *hidden, "linear2")

    def tied_sites(self, model: ModelConfig, layers: LayersConfig) -> dict[str, str]:
        # linear2 computes with W's transpose: its components are linear1's, transposed
        chosen = set(layers.sites)
        return ({"linear2": "linear1"} if layers.tie and {"linear1", "linear2"} <= chosen
                else {})

    def evaluate(self, model: ModelConfig, spec: EvalSpec, target: Any, components: Any,
                 ci_fn: Any, batches: list[Array], key: Array, ci: dict[str, dict[str, Any]]
                 ) -> dict[str, Any]:
        thr = spec.ci_threshold
        return {**metrics.tms_ground_truth(target, components,
                                           {s: v["max_ci"] > thr for s, v in ci.items()}),
                **metrics.one_hot_live(target, components, ci_fn, thr, model.n_features)}

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
    feature_low = -1.0

    def init_target(self, key: Array, model: ModelConfig, dtype: Any) -> Any:
        return toy_models.init_resid_mlp(key, model.n_features, model.d_embed,
                                         model.d_hidden, model.n_layers)

    def labels(self, x: Array) -> Array:
        return x + jax.nn.relu(x)

    def feature_scores(self, target: Any, model: ModelConfig) -> tuple[np.ndarray, float]:
        # what the MLP adds to output i for the one-hot input e_i (ideally 1.0): 100
        # features share 50 neurons, so interference leaves some well below 1 without the
        # feature being dropped
        eye = jnp.eye(model.n_features, dtype=jnp.float32)
        return np.asarray(jnp.diagonal(target(eye)) - 1.0), 0.25

    def trainable(self, target: Any) -> Any:
        # the fixed embedding the features are read in and out by
        return eqx.tree_at(lambda t: t.W_E, super().trainable(target), False)

    def site_names(self, model: ModelConfig) -> tuple[str, ...]:
        return tuple(f"layers.{i}.{w}" for i in range(model.n_layers)
                     for w in ("mlp_in", "mlp_out"))

    def evaluate(self, model: ModelConfig, spec: EvalSpec, target: Any, components: Any,
                 ci_fn: Any, batches: list[Array], key: Array, ci: dict[str, dict[str, Any]]
                 ) -> dict[str, Any]:
        return metrics.resid_one_to_one(target, components, ci_fn, spec.ci_threshold)


TMS_KIND = TMSKind()
RESID_MLP_KIND = ResidMLPKind()

"""The toy kinds: TMS and the residual MLP (their modules in pdecomp.targets.toy_models), trained
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

from pdecomp.core import sharding
from pdecomp.core.config import (
    ConfigError,
    DataConfig,
    DType,
    LayersConfig,
    ModelConfig,
    ResidMLPConfig,
    TMSConfig,
)
from pdecomp.kinds import EvalSpec, Kind, kind_of
from pdecomp.kinds import cache as targets
from pdecomp.spd import metrics, plots
from pdecomp.spd.components import Components
from pdecomp.targets import toy_models

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
        return {**tms_ground_truth(target, components,
                                           {s: v["max_ci"] > thr for s, v in ci.items()}),
                **one_hot_live(target, components, ci_fn, thr, model.n_features)}

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
        return resid_one_to_one(target, components, ci_fn, spec.ci_threshold)


TMS_KIND = TMSKind()
RESID_MLP_KIND = ResidMLPKind()


# The toys' own metrics: how the components match the features the target was built on.
def _match(target_vecs: np.ndarray, comp_vecs: np.ndarray) -> tuple[float, float, np.ndarray]:
    """MMCS and ML2R of target vectors [F, d] against component vectors [F, C, d].

    For each feature f: the component with the highest cosine similarity to the target's
    vector; MMCS is the mean of those maxima, ML2R the mean norm ratio of the matches.
    Pass live components only: in a 2-d space a dead component of negligible norm can
    point along a feature by chance, and cosine similarity ignores its scale.
    """
    t_norm = np.linalg.norm(target_vecs, axis=-1)  # [F]
    c_norm = np.linalg.norm(comp_vecs, axis=-1)  # [F, C]
    cos = np.einsum("fd,fcd->fc", target_vecs, comp_vecs) / np.maximum(
        t_norm[:, None] * c_norm, 1e-12)
    best = cos.argmax(-1)
    f = np.arange(len(best))
    return float(cos[f, best].mean()), float((c_norm[f, best] / t_norm).mean()), best


def tms_ground_truth(target: toy_models.TMS, components: Components,
                     live: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """MMCS/ML2R per TMS site over its live components (all when `live` is None).

    linear1's feature f writes W[f, :]; component c's counterpart is V[f, c]·U[c, :].
    linear2 reads feature f through column f of Wᵀ.
    """
    out = {}
    W = np.asarray(target.W)
    for site, comp in components.sites.items():
        V, U = np.asarray(comp.V), np.asarray(comp.U)
        if live is not None:
            keep = np.asarray(live[site], bool)
            if not keep.any():
                out[f"mmcs/{site}"], out[f"ml2r/{site}"] = 0.0, 0.0
                continue
            V, U = V[:, keep], U[keep]
        if site == "linear1":
            t, c = W, np.einsum("fc,cd->fcd", V, U)
        elif site == "linear2":
            t, c = W, np.einsum("dc,cf->fcd", V, U)
        else:
            continue
        out[f"mmcs/{site}"], out[f"ml2r/{site}"], _ = _match(t, c)
    return out


def one_hot_live(target: toy_models.TMS | toy_models.ResidMLP, components: Components, ci_fn,
                 threshold: float, n: int, value: float = 0.75) -> dict[str, int]:
    """Per site: components whose CI exceeds the threshold on some single-feature input
    value·e_f (f < n, the target's features). The view of the paper's CI-per-feature plots:
    unlike `live`, it cannot see a component that fires only when several features are on at
    once."""
    ci = metrics.causal_importances(target, components, ci_fn, value * jnp.eye(n, dtype=jnp.float32))
    return {f"live_one_hot/{s}": int((np.asarray(v) > threshold).any(0).sum())
            for s, v in ci.items()}


def resid_one_to_one(target: toy_models.ResidMLP, components: Components, ci_fn,
                     threshold: float) -> dict[str, int]:
    """Per mlp_in site: how many features activate exactly one component that no other
    feature activates (one-hot input e_f of value 1)."""
    eye = jnp.eye(target.W_E.shape[0], dtype=jnp.float32)
    ci = metrics.causal_importances(target, components, ci_fn, eye)
    out = {}
    for site, v in ci.items():
        if not site.endswith("mlp_in"):
            continue
        active = np.asarray(v) > threshold  # [F, C]
        per_comp = active.sum(0)
        one = [(row.sum() == 1) and per_comp[row.argmax()] == 1 for row in active]
        out[f"one_to_one/{site}"] = int(np.sum(one))
    return out

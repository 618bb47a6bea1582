"""Trained targets: the toys (TMS and the residual MLP) and a pathless Llama trained on the
synthetic language; their data, training, checks and on-disk cache.

A target is an Equinox module whose `__call__(x, linear)` routes every site's matmul through
the caller's `linear(site, x, W)`, and whose `site_weights()` gives each site's W [d_in, d_out].
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, PRNGKeyArray

from pdecomp import data, hosts, llama, losses, threefry
from pdecomp.components import LinearFn, frozen_linear
from pdecomp.config import ModelConfig
from pdecomp.kinds import site_names_of

CACHE_VERSION = "1"  # bump when target code changes what a cached target means


class TargetError(RuntimeError):
    """A trained target failed its checks (it cannot serve as ground truth)."""


def _whole_forward(target, dtype: Any) -> tuple[Callable, Callable]:
    """A toy's (prefix, suffix): no layer is worth skipping, so the prefix only casts and
    every forward runs the whole model (the LM-only `streams` and `live` are ignored)."""
    return (lambda x: x.astype(dtype)), lambda x, linear, streams=None, live=None: target(
        x, linear)


class TMS(eqx.Module):
    """Toy model of superposition: h = x @ W, out = ReLU(h @ Wᵀ + b), tied weights.

    The +ID variants put fixed identity layers between linear1 and linear2.
    """

    W: Float[Array, "n m"]
    b: Float[Array, " n"]
    hidden: list[Float[Array, "m m"]]

    def __call__(self, x: Float[Array, "*pos n"], linear: LinearFn = frozen_linear) -> Array:
        h = linear("linear1", x, self.W)
        for name, H in zip(self._hidden_names(), self.hidden):
            h = linear(name, h, H)
        return jax.nn.relu(linear("linear2", h, self.W.T) + self.b)

    def split(self, sites: Sequence[str], dtype: Any, remat_layers: bool = False
              ) -> tuple[Callable, Callable]:
        del sites, remat_layers
        return _whole_forward(self, dtype)

    def _hidden_names(self) -> list[str]:
        n = len(self.hidden)
        return ["hidden"] if n == 1 else [f"hidden.{i}" for i in range(n)]

    def site_weights(self) -> dict[str, Array]:
        return {"linear1": self.W, **dict(zip(self._hidden_names(), self.hidden)),
                "linear2": self.W.T}


class ResidMLP(eqx.Module):
    """Residual MLP: features embedded by a fixed W_E, ReLU MLP layers, read out by W_Eᵀ."""

    W_E: Float[Array, "n d"]
    W_in: list[Float[Array, "d h"]]
    b_in: list[Float[Array, " h"]]
    W_out: list[Float[Array, "h d"]]
    b_out: list[Float[Array, " d"]]

    def __call__(self, x: Float[Array, "*pos n"], linear: LinearFn = frozen_linear) -> Array:
        resid = x @ self.W_E
        for i in range(len(self.W_in)):
            h = jax.nn.relu(linear(f"layers.{i}.mlp_in", resid, self.W_in[i]) + self.b_in[i])
            resid = resid + linear(f"layers.{i}.mlp_out", h, self.W_out[i]) + self.b_out[i]
        return resid @ self.W_E.T

    def split(self, sites: Sequence[str], dtype: Any, remat_layers: bool = False
              ) -> tuple[Callable, Callable]:
        del sites, remat_layers
        return _whole_forward(self, dtype)

    def site_weights(self) -> dict[str, Array]:
        out = {}
        for i in range(len(self.W_in)):
            out[f"layers.{i}.mlp_in"] = self.W_in[i]
            out[f"layers.{i}.mlp_out"] = self.W_out[i]
        return out


Target = TMS | ResidMLP | llama.Llama


def sample_inputs(key: PRNGKeyArray, cfg: ModelConfig, batch_size: int
                  ) -> Float[Array, "batch n"]:
    """Sparse features: each active with probability p; value U[0,1] (TMS) or U[-1,1] (resid)."""
    k_on, k_val = jax.random.split(key)
    on = threefry.bernoulli(k_on, cfg.feature_prob, (batch_size, cfg.n_features))
    lo = 0.0 if cfg.kind == "tms" else -1.0
    val = threefry.uniform(k_val, (batch_size, cfg.n_features), lo, 1.0)
    return jnp.where(on, val, 0.0)


def labels(cfg: ModelConfig, x: Array) -> Array:
    """What the target is trained to output: x itself (TMS) or x + ReLU(x) (residual MLP)."""
    return x if cfg.kind == "tms" else x + jax.nn.relu(x)


def init_target(key: PRNGKeyArray, cfg: ModelConfig, dtype: Any = jnp.float32) -> Target:
    """A target of the right shapes with fresh weights (the gate's abstract target; a
    pathless Llama's weights)."""
    if cfg.kind == "llama":
        return llama.init_llama(key, llama.arch(cfg), dtype)
    if cfg.kind == "tms":
        n, m = cfg.n_features, cfg.d_hidden
        W = jax.random.normal(key, (n, m), jnp.float32) * jnp.sqrt(2.0 / (n + m))
        hidden = [jnp.eye(m, dtype=jnp.float32) for _ in range(cfg.n_hidden_layers)]
        return TMS(W, jnp.zeros((n,), jnp.float32), hidden)
    n, d, h, L = cfg.n_features, cfg.d_embed, cfg.d_hidden, cfg.n_layers
    k_e, *ks = jax.random.split(key, 1 + 2 * L)
    W_E = jax.random.normal(k_e, (n, d), jnp.float32)
    W_E = W_E / jnp.linalg.norm(W_E, axis=-1, keepdims=True)
    W_in = [jax.random.normal(ks[2 * i], (d, h)) * jnp.sqrt(1.0 / d) for i in range(L)]
    W_out = [jax.random.normal(ks[2 * i + 1], (h, d)) * jnp.sqrt(1.0 / h) for i in range(L)]
    return ResidMLP(W_E, W_in, [jnp.zeros((h,)) for _ in range(L)], W_out,
                    [jnp.zeros((d,)) for _ in range(L)])


def _trainable(target: Target) -> Target:
    """Filter spec: TMS hidden identities and the residual MLP's embedding stay fixed."""
    spec = jax.tree.map(lambda _: True, target)
    if isinstance(target, TMS):
        return eqx.tree_at(lambda t: t.hidden, spec, [False] * len(target.hidden))
    return eqx.tree_at(lambda t: t.W_E, spec, False)


def train_target(cfg: ModelConfig, seed: int,
                 on_progress: Callable[[int, float], None] | None = None) -> Target:
    """Train the target from its seed: a toy with Adam on MSE against `labels`, a Llama
    with AdamW on next-token CE over the synthetic language."""
    if cfg.kind == "llama":
        return _train_llama(cfg, seed, on_progress)
    init_key, data_key = jax.random.split(jax.random.PRNGKey(seed))
    target = init_target(init_key, cfg)
    params, static = eqx.partition(target, _trainable(target))

    def loss_fn(params, key):
        x = sample_inputs(key, cfg, cfg.train_batch_size)
        return jnp.mean((eqx.combine(params, static)(x) - labels(cfg, x)) ** 2)

    chunk = 500
    keys = jax.random.split(data_key, cfg.train_steps)
    chunks = ((min(s + chunk, cfg.train_steps), keys[s:s + chunk])
              for s in range(0, cfg.train_steps, chunk))
    return eqx.combine(_fit(params, loss_fn, optax.adam(cfg.train_lr), chunks, on_progress),
                       static)


def _fit(params: Any, loss_fn: Callable[[Any, Any], Array], opt: optax.GradientTransformation,
         chunks: Iterable[tuple[int, Any]],
         on_progress: Callable[[int, float], None] | None) -> Any:
    """Minimise `loss_fn(params, batch)` with `opt`, one compiled scan per chunk of stacked
    batches; `chunks` yields (steps done after the chunk, the chunk's batches)."""
    def step(carry, batch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    @jax.jit
    def run_chunk(params, opt_state, batches):
        (params, opt_state), losses_ = jax.lax.scan(step, (params, opt_state), batches)
        return params, opt_state, losses_[-1]

    opt_state = opt.init(params)
    for done, batches in chunks:
        params, opt_state, loss = run_chunk(params, opt_state, batches)
        if on_progress is not None:
            on_progress(done, float(loss))
    return params


# A trained Llama's CE may exceed the language's rate by this much: a row's first few ids
# have no context to predict them from, and a model that learned nothing sits near log(V).
LM_CE_SLACK = 0.5
LM_TRAIN_SEQ_LEN = 64
_LM_CHUNK = 25  # steps per compiled scan; the host draws the chunk's batches in between


def _language(cfg: ModelConfig, seed: int) -> data.TokenStream:
    return data.open_tokens(data.TokenSpec("synthetic", "", "uint16", "", LM_TRAIN_SEQ_LEN,
                                           cfg.vocab_size, seed))


def _train_llama(cfg: ModelConfig, seed: int,
                 on_progress: Callable[[int, float], None] | None) -> llama.Llama:
    steps = cfg.train_steps
    lr = optax.warmup_cosine_decay_schedule(0.0, cfg.train_lr, max(steps // 20, 1), steps,
                                            0.1 * cfg.train_lr)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0))
    stream = _language(cfg, seed)
    chunks = ((min(s + _LM_CHUNK, steps),
               np.stack([stream.rows(i, cfg.train_batch_size)
                         for i in range(s, min(s + _LM_CHUNK, steps))]))
              for s in range(0, steps, _LM_CHUNK))
    return _fit(init_target(jax.random.PRNGKey(seed), cfg),
                lambda model, tokens: losses.cross_entropy(model(tokens), tokens), opt, chunks,
                on_progress)


def target_report(target: Target, cfg: ModelConfig) -> dict[str, object]:
    """Did training give a target worth decomposing? `ok` says; `problem` says why not."""
    if cfg.kind != "llama":
        return feature_report(target, cfg)
    stream = _language(cfg, cfg.seed + 1_000_000)  # held-out rows, not the training seed's
    ce = float(np.mean([losses.cross_entropy(target(t), t) for t in
                        (jnp.asarray(stream.rows(i, 64)) for i in range(4))]))
    rate = data.synthetic_entropy(cfg.vocab_size)
    ok = ce <= rate + LM_CE_SLACK
    return {"ce": ce, "language_rate": rate, "slack": LM_CE_SLACK, "ok": ok,
            "problem": "" if ok else f"next-token CE {ce:.3f} nats is more than {LM_CE_SLACK} "
                                     f"above the language's {rate:.3f}"}


def feature_report(target: Target, cfg: ModelConfig) -> dict[str, object]:
    """Does the target represent every feature? The decomposition's ground truth needs it.

    TMS: a feature is represented when its embedding row has norm ≥ 0.5 (represented rows
    have norm ~1, dropped ones collapse to ~0). Residual MLP: when the MLP adds ≥ 0.25 of the
    ideal 1.0 to output i for the one-hot input e_i; 100 features share 50 neurons, so
    interference leaves some features well below 1 without the feature being dropped.
    """
    if isinstance(target, TMS):
        score, threshold = np.asarray(jnp.linalg.norm(target.W, axis=-1)), 0.5
    else:
        eye = jnp.eye(cfg.n_features, dtype=jnp.float32)
        score, threshold = np.asarray(jnp.diagonal(target(eye)) - 1.0), 0.25
    missing = [int(i) for i in np.flatnonzero(score < threshold)]
    problem = (f"misses features {missing} (scores below {threshold}; median "
               f"{float(np.median(score)):.3f})") if missing else ""
    return {"n_features": cfg.n_features, "missing": missing, "threshold": threshold,
            "min_score": float(score.min()), "median_score": float(np.median(score)),
            "ok": not missing, "problem": problem}


def cache_key(cfg: ModelConfig) -> str:
    fields = {k: v for k, v in asdict(cfg).items() if k not in ("name", "cache_dir", "max_retrain")}
    blob = json.dumps({"v": CACHE_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_dir(cfg: ModelConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("PDECOMP_CACHE") or Path.home() / ".cache" / "pdecomp"
    return Path(root) / "targets"


def cache_path(cfg: ModelConfig) -> Path:
    return cache_dir(cfg) / f"{cfg.name}-{cache_key(cfg)}"


def is_cached(cfg: ModelConfig) -> bool:
    """A complete cache entry (entries appear whole, by rename)."""
    path = cache_path(cfg)
    return (path / "meta.json").exists() and (path / "target.eqx").exists()


def load_or_train_target(cfg: ModelConfig, log: Callable[[str], None] = print,
                         on_progress: Callable[[int, float], None] | None = None
                         ) -> tuple[Target, dict[str, object]]:
    """The trained target for these settings: from the cache, or trained now and cached.

    A target that fails its check (a toy missing a feature, a Llama that did not learn
    the language) is retrained with the next seed, up to `max_retrain` times; if none
    passes this raises TargetError.
    """
    path = cache_path(cfg)
    skeleton = init_target(jax.random.PRNGKey(0), cfg)
    if is_cached(cfg):
        meta = json.loads((path / "meta.json").read_text())
        try:
            return eqx.tree_deserialise_leaves(path / "target.eqx", skeleton), meta
        except Exception as e:  # noqa: BLE001 - a corrupt cache entry is retrained, not trusted
            log(f"target cache at {path} unreadable ({e}); retraining")
    tried = []
    for attempt in range(cfg.max_retrain + 1):
        seed = cfg.seed + 1000 * attempt
        log(f"training target {cfg.name} (seed {seed}, {cfg.train_steps} steps)")
        target = train_target(cfg, seed, on_progress)
        report = target_report(target, cfg)
        tried.append({"seed": seed, **report})
        if report["ok"]:
            break
        log(f"target {cfg.name} seed {seed} {report['problem']}; retraining")
    else:
        what = ("learns the synthetic language" if cfg.kind == "llama"
                else f"represents all {cfg.n_features} features")
        raise TargetError(f"target {cfg.name}: no seed of {[t['seed'] for t in tried]} "
                          f"{what}: {tried}")
    meta = {"name": cfg.name, "seed": seed, "attempts": tried, "check": report,
            "sites": list(site_names_of(cfg))}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    eqx.tree_serialise_leaves(tmp / "target.eqx", target)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        tmp.rename(path)  # atomic: a concurrent or killed writer never leaves half a target
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return target, meta


TARGET_WAIT_S = 3600  # how long other ranks wait for rank 0 to train and cache a target


def load_shared_target(cfg: ModelConfig, log: Callable[[str], None]
                       ) -> tuple[Target, dict[str, object]]:
    """`load_or_train_target` for a job of one or many processes. In a multi-process job
    rank 0 trains and caches a missing target while the others wait for the cache entry,
    and then every process reads that entry, so all hold the same weights (whoever won a
    race to write it). The wait is on the file, not a collective: training can outlast any
    collective timeout, and a rank 0 that fails ends the job (srun --kill-on-bad-exit)."""
    if jax.process_count() == 1:
        return load_or_train_target(cfg, log=log)
    if hosts.is_main_process():
        load_or_train_target(cfg, log=log)
    deadline = time.monotonic() + TARGET_WAIT_S
    while not is_cached(cfg):
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {jax.process_index()}: no trained target at "
                               f"{cache_path(cfg)} after {TARGET_WAIT_S}s; the cache "
                               "($PDECOMP_CACHE) must be on a file system every node of the "
                               "job shares")
        time.sleep(1.0)
    return load_or_train_target(cfg, log=lambda _: None)

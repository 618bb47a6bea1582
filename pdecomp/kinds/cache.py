"""Targets trained in-process and cached on disk by their settings: a toy, or a pathless
Llama trained on the synthetic language. Each model kind says how its target is made,
trained and checked (`pdecomp.kinds.Kind`: `init_target`, `train_target`, `check_target`);
this module retries training with the next seed, caches whole entries by rename, and
shares one entry between the processes of a job.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, PRNGKeyArray

from pdecomp.core import processes as hosts
from pdecomp.core.config import ModelConfig
from pdecomp.kinds import kind_of, site_names_of

CACHE_VERSION = "1"  # bump when target code changes what a cached target means


class TargetError(RuntimeError):
    """A trained target failed its checks (it cannot serve as ground truth)."""


def init_target(key: PRNGKeyArray, cfg: ModelConfig, dtype: Any = jnp.float32) -> Any:
    """A target of the right shapes with fresh weights, as its kind makes it."""
    return kind_of(cfg).init_target(key, cfg, dtype)


def fit(params: Any, loss_fn: Callable[[Any, Any], Array], opt: optax.GradientTransformation,
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
                         ) -> tuple[Any, dict[str, object]]:
    """The trained target for these settings: from the cache, or trained now and cached.

    A target that fails its check (a toy missing a feature, a Llama that did not learn
    the language) is retrained with the next seed, up to `max_retrain` times; if none
    passes this raises TargetError.
    """
    kind, path = kind_of(cfg), cache_path(cfg)
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
        target = kind.train_target(cfg, seed, on_progress)
        report = kind.check_target(target, cfg)
        tried.append({"seed": seed, **report})
        if report["ok"]:
            break
        log(f"target {cfg.name} seed {seed} {report['problem']}; retraining")
    else:
        raise TargetError(f"target {cfg.name}: no seed of {[t['seed'] for t in tried]} "
                          f"{kind.trained_means(cfg)}: {tried}")
    meta = {"name": cfg.name, "seed": seed, "attempts": tried, "check": report,
            "sites": list(site_names_of(cfg))}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    eqx.tree_serialise_leaves(tmp / "target.eqx", target)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        tmp.rename(path)  # atomic: a concurrent or killed writer never leaves half a target
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, meta


TARGET_WAIT_S = 3600  # how long other ranks wait for rank 0 to train and cache a target


def load_shared_target(cfg: ModelConfig, log: Callable[[str], None]
                       ) -> tuple[Any, dict[str, object]]:
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

"""The Llama kind: a language model read from a Hugging Face directory (or, without one, a
Llama of the preset's shapes, trained on the synthetic language or left random), fed token
windows from a stream, compared by KL, evaluated by CE/KL with every site masked."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jaxtyping import Array

from pdecomp.core import sharding
from pdecomp.core.config import (
    EVAL_SEED_OFFSET,
    LLAMA_ATTN,
    LLAMA_MLP,
    ConfigError,
    DataConfig,
    DataSource,
    DType,
    LayersConfig,
    LlamaModelConfig,
    ModelConfig,
    check_positive,
    rope_problem,
)
from pdecomp.kinds import EvalSpec, Kind, site_C
from pdecomp.kinds import cache as targets
from pdecomp.spd import losses, metrics
from pdecomp.targets import data, hf_checkpoint, llama


def covered(model: ModelConfig, layers: LayersConfig) -> str:
    """Which of the model's layers the sites are in, and C: a preset made for another
    model (llama_tiny's layers 1-3 at C = 64 on a 30-layer model) says so at the start."""
    hooked = sorted({int(s.split(".")[1]) for s in layers.sites})
    Cs = sorted(set(site_C(model, layers).values()))
    runs, start = [], hooked[0]
    for a, b in zip(hooked, [*hooked[1:], None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    which = f"layer{'s' * (len(hooked) > 1)} {', '.join(runs)}"
    return (f"decomposing {len(layers.sites)} sites in {which} of its "
            f"{n_layers(model)}, C = {'/'.join(map(str, Cs))} per site")


def n_layers(model: ModelConfig) -> int:
    """Layers of a Llama: from config.json when a path is given, else `model.n_layers`."""
    if not model.path:
        return model.n_layers
    cfg_file = Path(model.path) / "config.json"
    try:
        return int(json.loads(cfg_file.read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError("model.path", model.path,
                          f"must be a Hugging Face model directory with a readable config.json "
                          f"({type(e).__name__}: {e})") from None


# A trained Llama's CE may exceed the language's rate by this much: a row's first few ids
# have no context to predict them from, and a model that learned nothing sits near log(V).
LM_CE_SLACK = 0.5
LM_TRAIN_SEQ_LEN = 64
_LM_CHUNK = 25  # steps per compiled scan; the host draws the chunk's batches in between


def _language(cfg: ModelConfig, seed: int) -> data.TokenStream:
    """The synthetic language a pathless Llama with train_steps learns (seed: its rows)."""
    return data.open_tokens(data.TokenSpec("synthetic", "", "uint16", "", LM_TRAIN_SEQ_LEN,
                                           cfg.vocab_size, seed))


@functools.lru_cache(maxsize=4)
def _open_tokens(spec: data.TokenSpec, scan: bool) -> data.TokenStream:
    return data.open_tokens(spec, scan)


def token_stream(model: ModelConfig, d: DataConfig, seed: int, held_out: bool = False,
                 scan: bool = True) -> data.TokenStream:
    """The training stream, or the held-out one the final evaluation reads (`scan`: every
    id checked, pdecomp.targets.data.open_tokens)."""
    spec = data.TokenSpec(d.source, d.path, d.token_dtype, d.column, d.seq_len,
                          arch(model).vocab_size, seed, d.documents)
    return _open_tokens(spec, scan).split(d.eval_frac, seed + EVAL_SEED_OFFSET)[held_out]


def arch(model: ModelConfig) -> llama.LlamaConfig:
    """The architecture of a run's Llama: config.json when a path is given, else the fields
    of the model config (a pathless preset such as llama3_8b carries the real shapes)."""
    if model.path:
        return hf_checkpoint.load_config(model.path)
    return llama.LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.d_embed, intermediate_size=model.d_mlp,
        num_hidden_layers=model.n_layers, num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads, head_dim=model.head_dim,
        rms_norm_eps=model.rms_norm_eps, rope_theta=model.rope_theta,
        rope_scaling=dict(model.rope_scaling) or None, tie_word_embeddings=model.tie_embeddings,
        bias=tuple(model.attn_bias),
        windows=(model.sliding_window,) * model.n_layers if model.sliding_window else (),
        qk_norm=model.qk_norm)


class LlamaKind(Kind):
    schema = LlamaModelConfig
    distance = "kl"
    distance_why = "a language model's outputs are next-token distributions"
    data_sources = data.TOKEN_SOURCES
    # a pathless Llama with no training steps keeps its random weights
    positive = ("d_embed", "n_layers", "train_steps", "train_batch_size", "train_lr")
    zero_ok = ("train_steps",)

    def site_names(self, model: ModelConfig) -> tuple[str, ...]:
        """By layer, attention q/k/v/o then MLP gate/up/down, named by HF module path."""
        return tuple(f"layers.{i}.{part}.{w}" for i in range(n_layers(model))
                     for part, ws in (("self_attn", LLAMA_ATTN), ("mlp", LLAMA_MLP)) for w in ws)

    def validate(self, model: ModelConfig) -> None:
        super().validate(model)
        m = model
        if m.path:
            n_layers(m)  # a readable config.json
            # A model this loader computes, and every tensor there with its shape (headers).
            try:
                hf_checkpoint.check_hf(m.path)
            except hf_checkpoint.CheckpointError as e:
                raise ConfigError("model.path", m.path, str(e)) from None
            return
        for key in ("vocab_size", "d_mlp", "n_heads", "n_kv_heads"):
            check_positive(f"model.{key}", getattr(m, key))
        check_positive("model.head_dim", m.head_dim, zero_ok=True)
        check_positive("model.rope_theta", m.rope_theta)
        if m.n_heads % m.n_kv_heads:
            raise ConfigError("model.n_kv_heads", m.n_kv_heads,
                              f"must divide model.n_heads ({m.n_heads})")
        if not m.head_dim and m.d_embed % m.n_heads:
            raise ConfigError("model.n_heads", m.n_heads, f"must divide model.d_embed "
                              f"({m.d_embed}) unless model.head_dim is set")
        if odd := [n for n in m.attn_bias if n not in LLAMA_ATTN]:
            raise ConfigError("model.attn_bias", odd[0], f"allowed: {', '.join(LLAMA_ATTN)}")
        check_positive("model.sliding_window", m.sliding_window, zero_ok=True)
        if problem := rope_problem(m.rope_scaling):
            name, value, allowed = problem
            raise ConfigError(f"model.rope_scaling.{name}", value, allowed)

    def validate_data(self, model: ModelConfig, data: DataConfig, seed: int,
                      scan: bool = True) -> None:
        """The token source opened as the run will open it, every id checked against the
        vocab (`scan`) and the dtype against its sidecar (pdecomp.targets.data), so a bad file ends
        here, before the launcher makes anything. The scan is kept per file, so the job
        reads it once more at most (not at all when it runs in the launcher's process)."""
        if data.source in (DataSource.tokens, DataSource.hf_dataset):
            token_stream(model, data, seed, scan=scan)

    def preflight(self, model: ModelConfig, data: DataConfig, seed: int) -> None:
        # The checkpoint's headers were checked by `validate`, which the job runs first.
        token_stream(model, data, seed)

    def init_target(self, key: Array, model: ModelConfig, dtype: Any) -> Any:
        return llama.init_llama(key, arch(model), dtype)

    def train_target(self, model: ModelConfig, seed: int,
                     on_progress: Callable[[int, float], None] | None) -> Any:
        """AdamW on next-token CE over the synthetic language."""
        steps = model.train_steps
        lr = optax.warmup_cosine_decay_schedule(0.0, model.train_lr, max(steps // 20, 1),
                                                steps, 0.1 * model.train_lr)
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0))
        stream = _language(model, seed)
        chunks = ((min(s + _LM_CHUNK, steps),
                   np.stack([stream.rows(i, model.train_batch_size)
                             for i in range(s, min(s + _LM_CHUNK, steps))]))
                  for s in range(0, steps, _LM_CHUNK))
        return targets.fit(self.init_target(jax.random.PRNGKey(seed), model, jnp.float32),
                           lambda m, tokens: losses.cross_entropy(m(tokens), tokens), opt,
                           chunks, on_progress)

    def check_target(self, target: Any, model: ModelConfig) -> dict[str, Any]:
        """Its CE on held-out rows of the language against the language's rate."""
        stream = _language(model, model.seed + 1_000_000)  # not the training seed's rows
        ce = float(np.mean([losses.cross_entropy(target(t), t) for t in
                            (jnp.asarray(stream.rows(i, 64)) for i in range(4))]))
        rate = data.synthetic_entropy(model.vocab_size)
        ok = ce <= rate + LM_CE_SLACK
        return {"ce": ce, "language_rate": rate, "slack": LM_CE_SLACK, "ok": ok,
                "problem": "" if ok else f"next-token CE {ce:.3f} nats is more than "
                                         f"{LM_CE_SLACK} above the language's {rate:.3f}"}

    def trained_means(self, model: ModelConfig) -> str:
        return "learns the synthetic language"

    def positions(self, data: DataConfig, batch_size: int) -> tuple[int, ...]:
        return (batch_size, data.seq_len)

    def tokens_per_example(self, data: DataConfig) -> int:
        return data.seq_len

    def batch_abstract(self, model: ModelConfig, data: DataConfig, batch_size: int,
                       sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((batch_size, data.seq_len), jnp.int32, sharding=sharding)

    def batch_sampler(self, model: ModelConfig, data: DataConfig, seed: int,
                      sharding: NamedSharding, key: Array, held_out: bool = False
                      ) -> Callable[[int], Array]:
        del key  # the stream is seeded by the run's seed
        stream = token_stream(model, data, seed, held_out)
        B = data.batch_size
        shape = (B, data.seq_len)
        # Each host reads only the rows its own devices hold.
        return lambda i: jax.make_array_from_callback(
            shape, sharding, lambda index: stream.rows(i, B, index[0]))

    def load(self, model: ModelConfig, layers: LayersConfig, target_dtype: DType,
             shardings: Any, log: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
        """Read from its HF directory into place; without a path, trained on the synthetic
        language and cached like a toy, or (no training steps) random weights made in place."""
        m, dtype = model, jnp.dtype(target_dtype)
        if m.path:
            log(f"loading {m.path} ({target_dtype}); {covered(m, layers)}")
            return hf_checkpoint.load_hf(m.path, dtype, shardings), {"path": m.path}
        if m.train_steps:
            target, meta = targets.load_shared_target(m, log)
            target = jax.tree.map(lambda w: w.astype(dtype), target)
            return sharding.put_from_host(target, shardings), meta
        log(f"model {m.name}: no model.path, random weights (seed {m.seed})")
        init = jax.jit(lambda k: self.init_target(k, m, dtype), out_shardings=shardings)
        return init(jax.random.PRNGKey(m.seed)), {"seed": m.seed}

    def direct_logits(self, target: Any, site: str, U: Array) -> Array | None:
        write = target.residual_write(site, U)
        return None if write is None else target.direct_logits(write)

    def evaluate(self, model: ModelConfig, spec: EvalSpec, target: Any, components: Any,
                 ci_fn: Any, batches: list[Array], key: Array, ci: dict[str, dict[str, Any]]
                 ) -> dict[str, Any]:
        out = metrics.lm_mask_metrics(self.eval_program(spec, tuple(components.sites)),
                                      target, components, ci_fn, batches, key, spec.pgd)
        if marks := spec.pgd.marks:  # another key: not the probe's adversary continued
            curve = metrics.lm_pgd_curve(target, components, ci_fn, batches,
                                         jax.random.fold_in(key, 1), spec.delta,
                                         jnp.dtype(spec.compute_dtype), spec.pgd, marks,
                                         spec.logits_chunk)
            out |= {f"kl/pgd_{m}": v for m, v in curve.items()}
        return out

    def eval_program(self, spec: EvalSpec, sites: tuple[str, ...]) -> Callable:
        return metrics.mask_metrics_program(sites, spec.ci_threshold, spec.delta,
                                            jnp.dtype(spec.compute_dtype), spec.pgd,
                                            spec.logits_chunk)


LLAMA_KIND = LlamaKind()

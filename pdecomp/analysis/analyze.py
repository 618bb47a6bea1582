"""A look inside a finished decomposition: `pdecomp analyze <run_dir>`.

Per site, every component's firing frequency (the fraction of positions with CI above the
run's `loss.ci_threshold`), mean and max CI and weight norm ‖V_c‖·‖U_c‖, with the dead
ones (never firing on the analysed data) counted; for a language model, the top-K
activating contexts of each component on held-out token windows; for a toy, the CI of each
component when one feature is active alone. Written as a static HTML page (sortable tables,
plots inline) with the plots as PNGs beside it, in `<run_dir>/analysis/`.

The data is the run's own: a Llama reads the held-out split of its token stream (the one
the final evaluation reads, `lm.token_stream(..., held_out=True)`), a toy samples inputs
from the evaluation seed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from pdecomp.analysis import gate as analysis_gate
from pdecomp.analysis import harvest, logit_effects
from pdecomp.analysis import state as analysis_state
from pdecomp.core import documents, storage
from pdecomp.core.config import EVAL_SEED_OFFSET
from pdecomp.kinds import site_names_of
from pdecomp.kinds import toy as toys
from pdecomp.kinds.language_model import arch, token_stream
from pdecomp.plan.resolve import Run
from pdecomp.run.load import (
    LoadedRun,
)
from pdecomp.spd import metrics

OUT_DIR = "analysis"
ONE_HOT_VALUE = 0.75  # the single-feature input value of toys.one_hot_live (and the paper)
CONTEXT_BEFORE, CONTEXT_AFTER = 12, 3  # tokens shown around a firing position
TOKENS_SHOWN = 8  # input / next tokens kept per component and ranking


@dataclass(frozen=True)
class SiteStats:
    """One site's components over the analysed positions (arrays of length C)."""

    freq: np.ndarray  # fraction of positions with CI > threshold
    mean_ci: np.ndarray
    max_ci: np.ndarray
    norm: np.ndarray  # ‖V[:, c]‖·‖U[c]‖, the Frobenius norm of the rank-one weight
    positions: int  # how many positions (token positions, toy inputs) were analysed
    hist: np.ndarray  # [C, bins]: positions per CI bin (harvest.HIST_EDGES)
    # LMs: the CE change (summed over the window, first order) of ablating the component
    # at one of its firing positions, on average; NaN where it never fires
    ablation: np.ndarray | None = None

    @property
    def dead(self) -> int:
        return int((self.freq == 0).sum())


@dataclass(frozen=True)
class Context:
    """One top activation of a component: the window's tokens around the firing position,
    with the component's CI at each of them."""

    ci: float
    window: int  # index among the analysed held-out windows
    position: int
    tokens: list[str]
    cis: list[float]
    at: int  # index of the firing position in `tokens`
    sep: str  # shown between tokens
    act: float  # the component's signed activation there, (x . V_c) ||U_c||


@dataclass(frozen=True)
class Analysis:
    run: LoadedRun
    stats: dict[str, SiteStats]
    contexts: dict[str, list[list[Context]]] | None  # site -> component -> top-K (LMs)
    feature_ci: dict[str, np.ndarray] | None  # site -> CI [features, C] (toys)
    data: str  # what was analysed, in words
    samples: dict[str, list[list[Context]]] | None = None  # the reservoirs (LMs)
    tokens: dict[str, harvest.TokenStats] | None = None  # input / next tokens (LMs)
    partners: dict[str, list[list[Partner]]] | None = None  # co-firing in the layer
    decoder: Tokens | None = None  # token id -> text (LMs)
    effects: dict[str, logit_effects.TokenEffects] | None = None  # promoted/suppressed (LMs)


@dataclass(frozen=True)
class Partner:
    """A component of the same layer firing with this one: P(it fires | this fires)."""

    site: str
    component: int
    p: float


@jax.jit
def _norms(components: Any) -> dict[str, Array]:
    """‖V[:, c]‖·‖U[c]‖ per site, on the devices the components live on (only [C] comes
    back to the host, whatever their size)."""
    return {s: jnp.linalg.norm(c.V.astype(jnp.float32), axis=0)
            * jnp.linalg.norm(c.U.astype(jnp.float32), axis=1)
            for s, c in components.sites.items()}


def weight_norms(run: LoadedRun) -> dict[str, np.ndarray]:
    return {s: np.asarray(v, np.float64) for s, v in _norms(run.components).items()}


def on_mesh(run: LoadedRun, x: Any) -> Array:
    """A batch on every device of the run's mesh (whole on each)."""
    return jax.device_put(x, NamedSharding(run.mesh, P()))


def options(run: Run, top_k: int, reservoir: int, cofire: bool, ablation: bool = True
            ) -> harvest.Options:
    """What one pass gathers: for a language model the top and reservoir examples, the
    token statistics and (`ablation`) the ablation effects; for both kinds the co-firing
    within each layer (`cofire`)."""
    lm = reads_tokens(run)
    return harvest.Options(
        run.config.loss.ci_threshold, top_k if lm else 0, reservoir if lm else 0,
        harvest.layer_groups(tuple(run.sites)) if cofire else (), lm, lm and ablation)


def reads_tokens(run: Run) -> bool:
    """A language model's run: analysed on held-out token windows, with top-k contexts; a
    toy's on sampled inputs, with each feature's CI."""
    return run.kind.tokens_per_example(run.config.data) > 0


def _lm_windows(run: LoadedRun, windows: int, batch_size: int, split: str = "held_out"
                ) -> Iterator[np.ndarray]:
    """The windows of `split` (held_out: those the final evaluation reads; train: the
    training stream's, from its first step), `batch_size` at a time (the last shorter)."""
    cfg = run.config
    stream = token_stream(cfg.model, cfg.data, cfg.seed, held_out=split == "held_out")
    B = run.config.data.batch_size
    # Window w is row w % B of evaluation batch w // B: the first data.eval_batches * B
    # windows are the very ones the final evaluation read.
    pending = np.empty((0, run.config.data.seq_len), np.int32)
    for step in range(math.ceil(windows / B)):
        pending = np.concatenate([pending, stream.rows(step, B)[:windows - step * B]])
        while len(pending) >= batch_size:
            yield pending[:batch_size]
            pending = pending[batch_size:]
    if len(pending):
        yield pending


def _toy_inputs(run: LoadedRun, inputs: int, batch_size: int) -> Iterator[Array]:
    key = jax.random.PRNGKey(run.config.seed + EVAL_SEED_OFFSET)
    for i, first in enumerate(range(0, inputs, batch_size)):
        yield toys.sample_inputs(jax.random.fold_in(key, i), run.config.model,
                                    min(batch_size, inputs - first))


class Tokens:
    """Token id -> text: the model directory's tokenizer.json when it has one and the
    `tokenizers` package is installed; the id otherwise."""

    def __init__(self, model_path: str):
        self.decode: Callable[[int], str] = str
        self.sep = " "  # between ids; decoded tokens carry their own spaces
        self.source = "token ids"
        self._tok: Any = None
        path = Path(model_path) / "tokenizer.json" if model_path else None
        if path is None or not path.is_file():
            return
        tok = self._tok = storage.read_tokenizer(path)
        self.decode = lambda i: tok.decode([i])
        self.sep = ""
        self.source = f"decoded with {path}"

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The text of each id of a run of tokens, as the run decodes: a character whose
        bytes span several tokens (byte-level BPE splits most non-ASCII ones) is shown
        whole on its last token, the others empty, not as one U+FFFD each."""
        if self._tok is None:
            return [self.decode(int(i)) for i in ids]
        out, shown = [], ""
        for k in range(len(ids)):
            text = self._tok.decode([int(i) for i in ids[:k + 1]])
            if text.endswith("\ufffd") and k + 1 < len(ids):  # a character not complete yet
                out.append("")
                continue
            out.append(text[len(shown):] if text.startswith(shown) else self.decode(ids[k]))
            shown = text
        return out


def component_stats(run: LoadedRun, o: harvest.Options, windows: int = 256,
                    inputs: int = 8192, batch_size: int | None = None,
                    progress: Callable[[int, int], None] | None = None,
                    split: str = "held_out", save_every: float | None = None
                    ) -> tuple[dict[str, harvest.SiteHarvest], dict[str, list[list[Partner]]],
                               np.ndarray | None]:
    """One pass over `windows` windows of `split` (Llama) or `inputs` sampled inputs (toys),
    in batches on the run's devices; `progress(done, total)` after each batch. With
    `save_every` (seconds), what the pass has gathered is saved that often beside the run
    and a pass with the same request goes on from there (pdecomp.analysis.state). Returns
    each site's harvest, its components' co-firing partners, and (Llama) the windows read."""
    lm = reads_tokens(run.run)
    B = batch_size or run.config.data.batch_size
    total = windows if lm else inputs
    if total <= 0:
        raise ValueError(f"nothing to analyse: {total} {'windows' if lm else 'inputs'}")
    batches = _lm_windows(run, windows, B, split) if lm else _toy_inputs(run, inputs, B)
    C = run.components.site_C
    vocab = arch(run.config.model).vocab_size if lm else 0
    request = {"step": run.step, "total": total, "batch": B, "split": split, "options": repr(o)}
    state = analysis_state.PassState(request, 0, 0, {
        s: harvest.SiteHarvest(C[s], o, vocab) for s in C}, [])
    step, cofire = jax.jit(harvest.step_fn(o), donate_argnums=5), cofire_zeros(run, o, C)
    if save_every is not None:
        state, cofire = analysis_state.load(run.run_dir, request, cofire) or (state, cofire)
    key, saved = jax.random.PRNGKey(run.config.seed + EVAL_SEED_OFFSET), time.monotonic()
    for i, x in enumerate(batches):
        if i < state.batches:  # read by the pass this one goes on from
            continue
        out, cofire = step(run.target, run.components, run.ci_fn, on_mesh(run, x),
                           jax.random.fold_in(key, i), cofire)
        ids = np.asarray(documents.ids(x)) if lm else None  # the windows' ids, flags cleared
        for s, h in state.sites.items():
            h.add(out[s], x.shape[0] * (x.shape[1] if lm else 1), ids)
        state.tokens += [ids] if lm else []
        state.batches, state.rows = i + 1, state.rows + x.shape[0]
        if save_every is not None and time.monotonic() - saved >= save_every:
            analysis_state.save(run.run_dir, state, cofire)
            saved = time.monotonic()
        if progress:
            progress(state.rows, total)
    return (state.sites, cofire_partners(o, C, cofire),
            np.concatenate(state.tokens) if lm else None)


def cofire_zeros(run: LoadedRun, o: harvest.Options, C: dict[str, int]) -> tuple[Array, ...]:
    """The co-firing counts of each group, zero, placed as the analysis gate placed them."""
    return tuple(jax.jit(lambda n=n: jnp.zeros((n, n), jnp.int32),
                         out_shardings=analysis_gate.cofire_rows(run.mesh, n))()
                 for n, _ in harvest.cofire_shapes(o, C))


PARTNERS = 5  # co-firing partners shown per component


def cofire_partners(o: harvest.Options, C: dict[str, int], cofire: Sequence[Array]
                    ) -> dict[str, list[list[Partner]]]:
    """Each component's PARTNERS most frequent co-firing components of its layer."""
    out: dict[str, list[list[Partner]]] = {}
    for group, counts in zip(o.groups, cofire):
        owner = [(s, c) for s in group for c in range(C[s])]
        if len(owner) < 2:
            continue
        p, idx = (np.asarray(a) for a in jax.jit(harvest.partners, static_argnums=1)(
            counts, PARTNERS))
        rows = [[Partner(*owner[j], float(q)) for q, j in zip(p[i], idx[i]) if q > 0]
                for i in range(len(owner))]
        start = 0
        for s in group:
            out[s], start = rows[start:start + C[s]], start + C[s]
    return out


def per_firing(h: harvest.SiteHarvest) -> np.ndarray | None:
    """The summed ablation effect per firing position (NaN where it never fires)."""
    if h.ablation is None:
        return None
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(h.fired > 0, h.ablation / h.fired, np.nan)


def contexts_of(ranked: harvest.Ranked, ids: np.ndarray, decoder: Tokens,
                fired_only: bool = False) -> list[list[Context]]:
    """Each component's ranked positions as contexts (`fired_only`: a reservoir's unfilled
    places, rank -1, left out)."""
    _, idx, val, act, along = ranked
    T = ids.shape[1]
    out = []
    for c in range(val.shape[0]):
        row = []
        for r, v, i, a, cis in zip(ranked[0][c], val[c], idx[c], act[c], along[c]):
            if fired_only and r < 0:
                continue
            w, t = divmod(int(i), T)
            lo, hi = max(t - CONTEXT_BEFORE, 0), min(t + CONTEXT_AFTER + 1, T)
            row.append(Context(float(v), w, t, decoder.pieces(ids[w, lo:hi]),
                               [float(x) for x in cis[lo:hi]], t - lo, decoder.sep,
                               float(a)))
        out.append(row)
    return out


def feature_ci(run: LoadedRun) -> dict[str, np.ndarray]:
    """Toys: per site, CI [features, C] of each component when feature f alone is on (at
    ONE_HOT_VALUE), the paper's per-feature CI view."""
    eye = on_mesh(run, ONE_HOT_VALUE * np.eye(run.config.model.n_features, dtype=np.float32))
    ci = metrics.causal_importances(run.target, run.components, run.ci_fn, eye)
    return {s: np.asarray(v, np.float64) for s, v in ci.items()}


def analyse(run: LoadedRun, windows: int = 256, inputs: int = 8192, top_k: int = 5,
            batch_size: int | None = None,
            progress: Callable[[int, int], None] | None = None, reservoir: int = 5,
            cofire: bool = True, split: str = "held_out", ablation: bool = True,
            save_every: float | None = None) -> Analysis:
    o = options(run.run, top_k, reservoir, cofire, ablation)
    sites, partners, ids = component_stats(run, o, windows, inputs, batch_size, progress,
                                           split, save_every)
    norms = weight_norms(run)
    order = [s for s in site_names_of(run.config.model) if s in sites]  # canonical order
    stats = {s: SiteStats(sites[s].fired / sites[s].positions,
                          sites[s].sum / sites[s].positions, sites[s].max, norms[s],
                          sites[s].positions, sites[s].hist, per_firing(sites[s]))
             for s in order}
    if ids is None:
        return Analysis(run, stats, None, feature_ci(run), f"{inputs} inputs sampled from "
                        "the evaluation seed", partners=partners)
    decoder = Tokens(run.config.model.path)
    tops = {s: contexts_of(sites[s].top, ids, decoder) for s in order if sites[s].top}
    drawn = {s: contexts_of(sites[s].reservoir, ids, decoder, fired_only=True)
             for s in order if sites[s].reservoir}
    cfg = run.config
    effects = {s: logit_effects.site_effects(cfg.model.kind, run.target, s,
                                             run.components.sites[s].U, TOKENS_SHOWN)
               for s in order}
    return Analysis(run, stats, tops or None, None,
                    f"{windows} {split.replace('_', '-')} windows of {cfg.data.seq_len} tokens "
                    f"({cfg.data.source}), {decoder.source}", drawn or None,
                    {s: sites[s].tokens for s in order if sites[s].tokens}, partners, decoder,
                    {s: e for s, e in effects.items() if e is not None})


# -- the report ------------------------------------------------------------------------------

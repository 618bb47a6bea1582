"""Which components fire on a text: `pdecomp prompt <run_dir> TEXT` (or `--ids 5,17,3`).

A language model's run only. The tokenizer of the run's model directory (or `--tokenizer
DIR`) encodes TEXT as the model's tokenizer does (its template's BOS, no EOS); the last
checkpoint's components and CI function (read as an analysis reads them) give, at each
token, every site's components whose CI is above the run's `loss.ci_threshold`. Printed per
token, strongest first (`--top N`, default 8), or as JSON lines (`--json`: one object per
token: position, id, text, and `firing`: [site, component, CI] triples).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pdecomp.analysis.analyze import Tokens
from pdecomp.core import storage
from pdecomp.run.load import LoadedRun
from pdecomp.spd import metrics

PROG = "pdecomp prompt"


def firing(loaded: LoadedRun, ids: Sequence[int]) -> list[list[tuple[str, int, float]]]:
    """Per position of `ids`, the (site, component, CI) with CI above the run's threshold,
    strongest first."""
    ci = metrics.causal_importances(loaded.target, loaded.components, loaded.ci_fn,
                                    jnp.asarray([list(ids)], jnp.int32))
    thr = loaded.run.config.loss.ci_threshold
    out: list[list[tuple[str, int, float]]] = [[] for _ in ids]
    for site, v in ci.items():
        v = np.asarray(v[0])
        for t, c in zip(*np.nonzero(v > thr)):
            out[t].append((site, int(c), float(v[t, c])))
    return [sorted(f, key=lambda x: -x[2]) for f in out]


def encode(tokenizer_dir: str, text: str) -> list[int] | None:
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return storage.read_tokenizer(path).encode(text).ids




def token_ids(loaded: LoadedRun, text: str | None, ids: str | None,
              tokenizer: str | None = None) -> list[int] | str:
    """The ids of `text` (the model's tokenizer, or `tokenizer`'s) or of `ids` (comma-
    separated), or the one line that says why there are none. At most the run's window of
    data.seq_len tokens: the positions its CI function was trained on."""
    if (text is None) == (ids is None):
        return "give a text or --ids, one of them"
    if ids is not None:
        try:
            out = [int(i) for i in ids.split(",")]
        except ValueError:
            return f"--ids {ids!r}: comma-separated integers"
    else:
        where = tokenizer or loaded.run.config.model.path
        out = encode(where, text) if where else None
        if out is None:
            return (f"no tokenizer.json in {where or 'the run (its model has no path)'}; "
                    "give --tokenizer DIR or --ids")
    vocab, longest = loaded.run.config.model.vocab_size, loaded.run.config.data.seq_len
    if not out or not all(0 <= i < vocab for i in out):
        return f"token ids must be in [0, {vocab}) and at least one: {out}"
    if len(out) > longest:
        return f"{len(out)} tokens: at most the run's data.seq_len, {longest}"
    return out


def per_token(loaded: LoadedRun, ids: list[int], tokenizer: str | None = None
              ) -> list[dict[str, Any]]:
    """Per token: its position, id, text and `firing`, [site, component, CI] strongest
    first."""
    pieces = Tokens(tokenizer or loaded.run.config.model.path).pieces(ids)
    return [{"position": t, "id": i, "text": text, "firing": [list(f) for f in fired]}
            for t, (i, text, fired) in enumerate(zip(ids, pieces, firing(loaded, ids)))]

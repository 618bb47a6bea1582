"""Which components fire on a text: `pdecomp prompt <run_dir> TEXT` (or `--ids 5,17,3`).

A language model's run only. The tokenizer of the run's model directory (or `--tokenizer
DIR`) encodes TEXT as the model's tokenizer does (its template's BOS, no EOS); the last
checkpoint's components and CI function (read as an analysis reads them) give, at each
token, every site's components whose CI is above the run's `loss.ci_threshold`. Printed per
token, strongest first (`--top N`, default 8), or as JSON lines (`--json`: one object per
token: position, id, text, and `firing`: [site, component, CI] triples).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from pdecomp import metrics, storage
from pdecomp.analyze import Tokens, reads_tokens
from pdecomp.commands import Parser, refuse
from pdecomp.runs import LoadedRun, RunDirError, load_run

PROG = "pdecomp prompt"


def firing(loaded: LoadedRun, ids: Sequence[int]) -> list[list[tuple[str, int, float]]]:
    """Per position of `ids`, the (site, component, CI) with CI above the run's threshold,
    strongest first."""
    ci = metrics.causal_importances(loaded.target, loaded.components, loaded.ci_fn,
                                    jnp.asarray([list(ids)], jnp.int32))
    thr = loaded.run.loss.ci_threshold
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


def parser() -> Parser:
    p = Parser(prog=PROG,
               description="Show which components of a language model's run fire on a text, "
                           "token by token.")
    p.add_argument("run_dir", help="a run directory (config.yaml and checkpoints/)")
    p.add_argument("text", nargs="?", help="the text (encoded with the model's tokenizer)")
    p.add_argument("--ids", help="token ids instead of a text, comma-separated")
    p.add_argument("--tokenizer", help="a directory with tokenizer.json (default: the "
                                       "run's model.path)")
    p.add_argument("--top", type=int, default=8, help="components shown per token")
    p.add_argument("--json", action="store_true", help="JSON lines, every firing component")
    return p


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
        where = tokenizer or loaded.run.model.path
        out = encode(where, text) if where else None
        if out is None:
            return (f"no tokenizer.json in {where or 'the run (its model has no path)'}; "
                    "give --tokenizer DIR or --ids")
    vocab, longest = loaded.run.model.vocab_size, loaded.run.data.seq_len
    if not out or not all(0 <= i < vocab for i in out):
        return f"token ids must be in [0, {vocab}) and at least one: {out}"
    if len(out) > longest:
        return f"{len(out)} tokens: at most the run's data.seq_len, {longest}"
    return out


def per_token(loaded: LoadedRun, ids: list[int], tokenizer: str | None = None
              ) -> list[dict[str, Any]]:
    """Per token: its position, id, text and `firing`, [site, component, CI] strongest
    first."""
    pieces = Tokens(tokenizer or loaded.run.model.path).pieces(ids)
    return [{"position": t, "id": i, "text": text, "firing": [list(f) for f in fired]}
            for t, (i, text, fired) in enumerate(zip(ids, pieces, firing(loaded, ids)))]


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    if args.top < 1:
        return refuse(PROG, f"--top {args.top}: at least 1")
    try:
        loaded = load_run(args.run_dir, log=lambda _: None, whole_state=False)
    except RunDirError as e:
        return refuse(PROG, f"{e}; expects a run directory with config.yaml and checkpoints/")
    if not reads_tokens(loaded.run):
        return refuse(PROG, f"{args.run_dir}: a {loaded.run.model.kind} run reads no tokens; "
                            "only a language model's")
    ids = token_ids(loaded, args.text, args.ids, args.tokenizer)
    if isinstance(ids, str):
        return refuse(PROG, ids)
    for tok in per_token(loaded, ids, args.tokenizer):
        if args.json:
            print(json.dumps(tok))
        else:
            fired = tok["firing"]
            shown = ", ".join(f"{s}:{c} {v:.2f}" for s, c, v in fired[:args.top])
            more = f" (+{len(fired) - args.top})" if len(fired) > args.top else ""
            print(f"{tok['position']:4d} {tok['text']!r:>16} {shown or '-'}{more}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

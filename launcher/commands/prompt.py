"""`pdecomp prompt <run_dir> TEXT`: which components fire on each token of a text
(pdecomp.analysis.prompt)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from launcher.commands.common import Parser, refuse
from pdecomp.analysis.analyze import reads_tokens
from pdecomp.analysis.prompt import PROG, per_token, token_ids
from pdecomp.run.load import RunDirError, load_run


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


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    if args.top < 1:
        return refuse(PROG, f"--top {args.top}: at least 1")
    try:
        loaded = load_run(args.run_dir, log=lambda _: None, whole_state=False)
    except RunDirError as e:
        return refuse(PROG, f"{e}; expects a run directory with config.yaml and checkpoints/")
    if not reads_tokens(loaded.run):
        kind = loaded.run.config.model.kind
        return refuse(PROG, f"{args.run_dir}: a {kind} run reads no tokens; "
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

"""`pdecomp tokenize INPUTS --model M -o FILE`: a corpus as a flat token file
(pdecomp.targets.text, pdecomp.targets.corpus)."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from launcher.commands.common import Parser, progress_bar, refuse
from pdecomp.core.config import ConfigError
from pdecomp.targets import corpus
from pdecomp.targets.data import sidecar_of, starts_of
from pdecomp.targets.hub import local_model_dir
from pdecomp.targets.text import (
    TokenizeError,
    encoded,
    model_tokenizer,
    template_specials,
    write,
)


def parser() -> Parser:

    p = Parser(prog="pdecomp tokenize",
               description="Encode a corpus (text files, JSONL, Parquet, or a datasets hub "
                           "id) with a model's tokenizer into a flat token file (and its "
                           ".json sidecar) for data.source=tokens data.path=<file>: each "
                           "document as the tokenizer encodes it (BOS where its template "
                           "adds one), followed by the model's EOS; streamed, in bounded "
                           "memory.")
    p.add_argument("inputs", nargs="*", help="text, .jsonl or .parquet files, or directories "
                                             "to search (--glob)")
    p.add_argument("--model", required=True, help="a Hugging Face model directory "
                   "(tokenizer.json, config.json) or hub id")
    p.add_argument("-o", "--output", required=True, help="the token file to write (new)")
    p.add_argument("--glob", default="*.txt,*.jsonl,*.parquet",
                   help="files taken from a directory, comma-separated patterns "
                        "(default *.txt,*.jsonl,*.parquet)")
    p.add_argument("--column", default="text",
                   help="JSONL, Parquet and datasets: the field holding the text (default text)")
    p.add_argument("--paragraphs", action="store_true", help="text files: each "
                   "blank-line-separated paragraph is a document (default: a file)")
    p.add_argument("--dataset", default="", help="a datasets hub id, streamed "
                   "(e.g. HuggingFaceFW/fineweb-edu), after any inputs")
    p.add_argument("--name", default=None, help="--dataset's configuration (e.g. sample-10BT)")
    p.add_argument("--split", default="train", help="--dataset's split (default train)")
    p.add_argument("--max-documents", type=int, default=None,
                   help="stop after this many documents")
    p.add_argument("--seed", type=int, default=None, help="shuffle the documents with this "
                   "seed (holds every document in memory; default: in order, streamed)")
    return p


def check_args(args: argparse.Namespace) -> tuple[Path, corpus.Corpus]:
    """The output and the corpus, each checked as far as headers tell: TokenizeError."""
    out = Path(args.output)
    if out.exists() or sidecar_of(out).exists() or starts_of(out).exists():
        raise TokenizeError(f"-o {out}: exists; give a new file")
    if not out.parent.is_dir():
        raise TokenizeError(f"-o {out}: its directory {out.parent} does not exist")
    if not args.inputs and not args.dataset:
        raise TokenizeError("no inputs: give files or directories, or --dataset ID")
    if args.max_documents is not None and args.max_documents < 1:
        raise TokenizeError(f"--max-documents {args.max_documents}: give 1 or more")
    source = corpus.Corpus(tuple(corpus.input_files(args.inputs, args.glob)), args.column,
                           args.paragraphs, args.dataset, args.name, args.split)
    corpus.check(source)
    return out, source


def main(argv: list[str]) -> int:
    """`pdecomp tokenize`: 0, or 2 with one line and nothing written."""

    args = parser().parse_args(argv)
    # pyarrow's default allocator (mimalloc) keeps the pages of the row groups it decoded,
    # so this process would grow with the corpus (+16 MB per 15 MB of Parquet text read,
    # measured); the system allocator hands them back.
    import pyarrow as pa
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        out, source = check_args(args)
        tok, eos, vocab = model_tokenizer(local_model_dir(args.model, "--model"))
        docs: Iterable[str] = itertools.islice(corpus.documents(source), args.max_documents)
        if args.seed is not None:
            docs = list(docs)
            docs = [docs[i] for i in np.random.default_rng(args.seed).permutation(len(docs))]
        total = len(docs) if isinstance(docs, list) else corpus.count(source)
        if total is not None and args.max_documents is not None:
            total = min(total, args.max_documents)
        update, stop = progress_bar(total, "documents")
        record = {"inputs": [str(f) for f in source.files] + [source.dataset] * bool(
            source.dataset), "tokenizer": str(args.model), "bos": template_specials(tok),
            "eos": eos, "shuffled_with_seed": args.seed}
        try:
            side = write(out, encoded(tok, docs, eos), vocab, record, lambda n: update(n, 0))
        finally:
            stop()
    except (TokenizeError, ConfigError) as e:
        return refuse("pdecomp tokenize", str(e))
    print(f"{side['count']:,} tokens ({side['dtype']}) from {side['documents']:,} documents, "
          f"each followed by EOS {eos}", file=sys.stderr)
    print(out)
    return 0

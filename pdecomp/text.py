"""`pdecomp tokenize`: a corpus as a flat token file that `data.source=tokens` reads as is.

The corpus is read as a stream (`pdecomp.corpus`: text files, JSON Lines, Parquet, a
`datasets` hub id), encoded a batch of documents at a time with the model's tokenizer and
written as it goes, so memory stays bounded whatever the corpus's size. Each document is
encoded as the tokenizer's own config says (its template adds BOS where the model expects
one, as `tokenizer(text)` does in transformers) and followed by the model's EOS. The ids are
uint16 when the vocabulary fits, else uint32; the sidecar records the dtype, the count and
what was done (inputs, documents, BOS/EOS). The file and its sidecar appear together,
renamed into place; a run that stops on an input it cannot read leaves nothing behind.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from pdecomp import corpus
from pdecomp.data import as_token_dtype, sidecar_of, write_sidecar

BATCH = 64  # documents encoded per call (the tokenizers package threads each call)
TokenizeError = corpus.CorpusError


def model_tokenizer(model_dir: str | Path) -> tuple[object, int, int]:
    """The tokenizer of a Hugging Face model directory, its EOS id and vocabulary size."""
    from tokenizers import Tokenizer

    d = Path(model_dir)
    for name in ("tokenizer.json", "config.json"):
        if not (d / name).is_file():
            raise TokenizeError(f"--model {d}: no {name} (a Hugging Face model directory, "
                                "as `pdecomp convert` writes)")
    try:
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        config = json.loads((d / "config.json").read_text())
    except Exception as e:  # noqa: BLE001 - the tokenizers package's and json's errors
        raise TokenizeError(f"--model {d}: unreadable tokenizer.json or config.json: "
                            f"{e}") from None
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        raise TokenizeError(f"--model {d}: config.json has no eos_token_id to separate "
                            "documents with")
    vocab = int(config.get("vocab_size") or tok.get_vocab_size(with_added_tokens=True))
    return tok, eos, vocab


def encoded(tok: object, docs: Iterable[str], eos: int) -> Iterator[tuple[int, np.ndarray]]:
    """Each batch of documents as (documents in it, their ids): every document as the
    tokenizer's template encodes it, followed by `eos` unless it already ends with it."""
    docs = iter(docs)
    while batch := list(itertools.islice(docs, BATCH)):
        pieces = []
        for e in tok.encode_batch(batch, add_special_tokens=True):
            ids = e.ids if e.ids[-1:] == [eos] else [*e.ids, eos]
            pieces.append(np.asarray(ids, np.int64))
        yield len(batch), np.concatenate(pieces)


def write(out: Path, batches: Iterable[tuple[int, np.ndarray]], vocab: int,
          record: dict, progress: Callable[[int], None] | None = None) -> dict:
    """The ids of `batches`, appended to `out` as they come, and the sidecar (`record`,
    the dtype, the count and the documents), both renamed into place at the end; nothing
    is left behind if it stops. The sidecar as written."""
    dtype = "uint16" if vocab <= 2 ** 16 else "uint32"
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    n_docs = n_ids = 0
    try:
        with tmp.open("wb") as f:
            for k, ids in batches:
                try:
                    as_token_dtype(ids, dtype).tofile(f)
                except ValueError as e:  # the tokenizer's added ids beyond config.json's vocab
                    raise TokenizeError(f"-o {out}: {e} (vocab_size {vocab})") from None
                n_docs, n_ids = n_docs + k, n_ids + len(ids)
                if progress:
                    progress(n_docs)
        if not n_docs:
            raise TokenizeError("the inputs hold no text")
        side = write_sidecar(tmp, dtype, n_ids, {**record, "documents": n_docs})
        os.replace(sidecar_of(tmp), sidecar_of(out))
        os.replace(tmp, out)
    except BaseException:
        for p in (tmp, sidecar_of(tmp), sidecar_of(out)):
            p.unlink(missing_ok=True)
        raise
    return side


def template_specials(tok: object) -> list[int]:
    """The ids the tokenizer's template puts around every document (BOS, say): those it
    gives an empty text."""
    return list(tok.encode("", add_special_tokens=True).ids)


def parser() -> object:
    from pdecomp.commands import Parser

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


def check_args(args: object) -> tuple[Path, corpus.Corpus]:
    """The output and the corpus, each checked as far as headers tell: TokenizeError."""
    out = Path(args.output)
    if out.exists() or sidecar_of(out).exists():
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
    from pdecomp.commands import progress_bar, refuse
    from pdecomp.config import ConfigError
    from pdecomp.hub import local_model_dir

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

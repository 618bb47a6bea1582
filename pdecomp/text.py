"""`pdecomp tokenize`: text files as a flat token file that `data.source=tokens` reads as is.

Each file is a document (or each blank-line-separated paragraph, with `--paragraphs`);
documents are encoded with the model directory's tokenizer.json and each is followed by the
model's EOS. The ids are uint16 when the vocabulary fits, else uint32, written with their
sidecar (`pdecomp.data.write_tokens`). Every input is read and checked before anything is
written, and the file and its sidecar appear together, renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from pdecomp.data import sidecar_of, write_tokens

BATCH = 64  # documents encoded per call (the tokenizers package threads each call)


class TokenizeError(ValueError):
    """An input `pdecomp tokenize` refuses; `str()` is the one line."""


def text_files(paths: Sequence[str | Path], glob: str) -> list[Path]:
    """The files named, and those under the directories named that match `glob`, sorted."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob(glob) if f.is_file())
            if not found:
                raise TokenizeError(f"{p}: no file matching {glob!r} under it (--glob)")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise TokenizeError(f"{p}: no such file or directory")
    return files


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


def documents(files: Sequence[Path], paragraphs: bool) -> list[str]:
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TokenizeError(f"{f}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except OSError as e:
            raise TokenizeError(f"{f}: unreadable: {e.strerror}") from None
        parts = re.split(r"\n\s*\n", text) if paragraphs else [text]
        docs += [p for p in parts if p.strip()]
    if not docs:
        raise TokenizeError("the inputs hold no text")
    return docs


def encode(tok: object, docs: Sequence[str], eos: int,
           progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Every document's ids, each followed by `eos`, as one int64 array."""
    pieces = []
    for lo in range(0, len(docs), BATCH):
        for e in tok.encode_batch(list(docs[lo:lo + BATCH]), add_special_tokens=False):
            pieces += [np.asarray(e.ids, np.int64), np.array([eos], np.int64)]
        if progress:
            progress(min(lo + BATCH, len(docs)), len(docs))
    return np.concatenate(pieces)


def write(out: Path, ids: np.ndarray, vocab: int) -> str:
    """The ids and their sidecar at `out`, both renamed into place; the dtype written."""
    dtype = "uint16" if vocab <= 2 ** 16 else "uint32"
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        write_tokens(tmp, ids, dtype)
        os.replace(sidecar_of(tmp), sidecar_of(out))
        os.replace(tmp, out)
    except BaseException:
        for p in (tmp, sidecar_of(tmp), sidecar_of(out)):
            p.unlink(missing_ok=True)
        raise
    return dtype


def parser() -> object:
    from pdecomp.commands import Parser

    p = Parser(prog="pdecomp tokenize",
               description="Encode text files with a model directory's tokenizer into a flat "
                           "token file (and its .json sidecar) for data.source=tokens "
                           "data.path=<file>: each document followed by the model's EOS.")
    p.add_argument("inputs", nargs="+", help="text files, or directories to search (--glob)")
    p.add_argument("--model", required=True, help="a Hugging Face model directory "
                                                  "(tokenizer.json, config.json)")
    p.add_argument("-o", "--output", required=True, help="the token file to write (new)")
    p.add_argument("--glob", default="*.txt", help="files taken from a directory "
                                                   "(default *.txt)")
    p.add_argument("--paragraphs", action="store_true",
                   help="each blank-line-separated paragraph is a document (default: a file)")
    p.add_argument("--seed", type=int, default=None,
                   help="shuffle the documents with this seed (default: in the given order)")
    return p


def main(argv: list[str]) -> int:
    """`pdecomp tokenize`: 0, or 2 with one line and nothing written."""
    from pdecomp.commands import progress_bar, refuse

    args = parser().parse_args(argv)
    out = Path(args.output)
    try:
        if out.exists() or sidecar_of(out).exists():
            raise TokenizeError(f"-o {out}: exists; give a new file")
        if not out.parent.is_dir():
            raise TokenizeError(f"-o {out}: its directory {out.parent} does not exist")
        tok, eos, vocab = model_tokenizer(args.model)
        docs = documents(text_files(args.inputs, args.glob), args.paragraphs)
    except TokenizeError as e:
        return refuse("pdecomp tokenize", str(e))
    if args.seed is not None:
        docs = [docs[i] for i in np.random.default_rng(args.seed).permutation(len(docs))]
    update, stop = progress_bar(len(docs), "documents")
    try:
        ids = encode(tok, docs, eos, update)
    finally:
        stop()
    dtype = write(out, ids, vocab)
    print(f"{len(ids):,} tokens ({dtype}) from {len(docs):,} documents, each followed by EOS "
          f"{eos}", file=sys.stderr)
    print(out)
    return 0

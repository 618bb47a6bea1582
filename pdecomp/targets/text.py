"""`pdecomp tokenize`: a corpus as a flat token file that `data.source=tokens` reads as is.

The corpus is read as a stream (`pdecomp.targets.corpus`: text files, JSON Lines, Parquet, a
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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from pdecomp.targets import corpus
from pdecomp.targets.data import as_token_dtype, sidecar_of, starts_of, write_sidecar

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


def encoded(tok: object, docs: Iterable[str], eos: int
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each batch of documents as (each one's length, their ids back to back): every
    document as the tokenizer's template encodes it, followed by `eos` unless it already
    ends with it."""
    docs = iter(docs)
    while batch := list(itertools.islice(docs, BATCH)):
        pieces = []
        for e in tok.encode_batch(batch, add_special_tokens=True):
            ids = e.ids if e.ids[-1:] == [eos] else [*e.ids, eos]
            pieces.append(np.asarray(ids, np.int64))
        yield np.asarray([len(p) for p in pieces]), np.concatenate(pieces)


def write(out: Path, batches: Iterable[tuple[np.ndarray, np.ndarray]], vocab: int,
          record: dict, progress: Callable[[int], None] | None = None) -> dict:
    """The ids of `batches` ((each document's length, their ids)), appended to `out` as
    they come, where each document starts (`<out>.starts`, data.starts_of) and the sidecar
    (`record`, the dtype, the count, the documents), all renamed into place at the end;
    nothing is left behind if it stops. The sidecar as written."""
    dtype = "uint16" if vocab <= 2 ** 16 else "uint32"
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    n_docs = n_ids = 0
    try:
        with tmp.open("wb") as f, starts_of(tmp).open("wb") as starts:
            for lengths, ids in batches:
                try:
                    as_token_dtype(ids, dtype).tofile(f)
                except ValueError as e:  # the tokenizer's added ids beyond config.json's vocab
                    raise TokenizeError(f"-o {out}: {e} (vocab_size {vocab})") from None
                (n_ids + np.cumsum([0, *lengths[:-1]])).astype("<u8").tofile(starts)
                n_docs, n_ids = n_docs + len(lengths), n_ids + len(ids)
                if progress:
                    progress(n_docs)
        if not n_docs:
            raise TokenizeError("the inputs hold no text")
        side = write_sidecar(tmp, dtype, n_ids, {**record, "documents": n_docs,
                                                 "document_starts": starts_of(out).name})
        os.replace(starts_of(tmp), starts_of(out))
        os.replace(sidecar_of(tmp), sidecar_of(out))
        os.replace(tmp, out)
    except BaseException:
        for p in (tmp, sidecar_of(tmp), starts_of(tmp), sidecar_of(out), starts_of(out)):
            p.unlink(missing_ok=True)
        raise
    return side


def template_specials(tok: object) -> list[int]:
    """The ids the tokenizer's template puts around every document (BOS, say): those it
    gives an empty text."""
    return list(tok.encode("", add_special_tokens=True).ids)

"""The documents of a corpus, streamed one batch at a time: text files (a file, or each
blank-line-separated paragraph, a document), JSON Lines and Parquet files (one document per
row, from a text column), and a `datasets` hub id (streamed, nothing downloaded whole).

What can be checked without reading the documents is checked first (the files exist, a
Parquet file's column is there and holds strings, a JSONL file's first row has it), so a
mistake in the command ends before any work; what only the documents show (a file that is
not UTF-8, a row without the column) ends the stream with one line naming file and row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROWS_PER_READ = 1024  # Parquet rows decoded at a time: the bound on documents held


class CorpusError(ValueError):
    """An input the corpus reader refuses; `str()` is the one line."""


@dataclass(frozen=True)
class Corpus:
    files: tuple[Path, ...]  # local inputs, in order
    column: str = "text"  # JSONL / Parquet / datasets: the field holding each document
    paragraphs: bool = False  # text files: each paragraph a document
    dataset: str = ""  # a `datasets` hub id (`org/name`), streamed
    name: str | None = None  # the dataset's configuration (`sample-10BT`)
    split: str = "train"


def kind(path: Path) -> str:
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(
        path.suffix.lower(), "text")


def input_files(paths: Sequence[str | Path], globs: str) -> list[Path]:
    """The files named, and those under the directories named that match one of `globs`
    (comma-separated), each directory's sorted."""
    patterns = [g.strip() for g in globs.split(",") if g.strip()]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted({f for g in patterns for f in p.rglob(g) if f.is_file()})
            if not found:
                raise CorpusError(f"{p}: no file matching {globs!r} under it (--glob)")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise CorpusError(f"{p}: no such file or directory")
    return files


def check(corpus: Corpus) -> None:
    """What the inputs' headers show: each Parquet file has the column as strings, each
    JSONL file's first row has it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in corpus.files:
        if kind(f) == "parquet":
            try:
                schema = pq.read_schema(f)
            except (OSError, pa.ArrowException) as e:
                raise CorpusError(f"{f}: not a readable Parquet file ({e})") from None
            if corpus.column not in schema.names:
                raise CorpusError(f"{f}: no column {corpus.column!r} (--column); it has "
                                  f"{', '.join(schema.names)}")
            t = schema.field(corpus.column).type
            if not is_text(t):
                raise CorpusError(f"{f}: column {corpus.column!r} holds {t}, not text")
        elif kind(f) == "jsonl":
            next(_jsonl(f, corpus.column), None)


def is_text(t: Any) -> bool:
    """A Parquet column type that holds strings: plain, large, a view, or dictionary-encoded
    strings (as pandas writes a categorical)."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or view(t)


def documents(corpus: Corpus) -> Iterator[str]:
    """Every non-empty document, in input order."""
    if corpus.dataset:
        yield from _hub_dataset(corpus)
    for f in corpus.files:
        reader = {"text": _text, "jsonl": _jsonl, "parquet": _parquet}[kind(f)]
        arg = corpus.paragraphs if kind(f) == "text" else corpus.column
        yield from (d for d in reader(f, arg) if d.strip())


def count(corpus: Corpus) -> int | None:
    """How many documents the inputs hold, where the headers say it cheaply (for progress):
    a text file is one, a Parquet file says its rows; None where only reading tells."""
    import pyarrow.parquet as pq

    if corpus.dataset or (corpus.paragraphs and any(kind(f) == "text" for f in corpus.files)):
        return None
    if any(kind(f) == "jsonl" for f in corpus.files):
        return None
    return sum(pq.ParquetFile(f).metadata.num_rows if kind(f) == "parquet" else 1
               for f in corpus.files)


def _text(f: Path, paragraphs: bool) -> Iterator[str]:
    try:
        text = f.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{f}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise CorpusError(f"{f}: unreadable: {e.strerror}") from None
    yield from re.split(r"\n\s*\n", text) if paragraphs else [text]


def _jsonl(f: Path, column: str) -> Iterator[str]:
    with f.open("rb") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, UnicodeDecodeError) as e:
                raise CorpusError(f"{f}: line {n} is not JSON ({e})") from None
            value = row.get(column) if isinstance(row, dict) else None
            if not isinstance(value, str):
                have = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                raise CorpusError(f"{f}: line {n} has no text field {column!r} (--column); "
                                  f"it has {have}")
            yield value


def _parquet(f: Path, column: str) -> Iterator[str]:
    # Not pre-buffered: that would read every row group's column chunk ahead of use.
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 20)
    batches = rows.iter_batches(batch_size=ROWS_PER_READ, columns=[column])
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as e:  # a row group damaged past the header
            raise CorpusError(f"{f}: damaged Parquet data ({e})") from None
        if batch is None:
            return
        yield from (d for d in batch.column(0).to_pylist() if d is not None)


def _hub_dataset(corpus: Corpus) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"--dataset {corpus.dataset}: needs the datasets package "
                          "(pip install datasets)") from None
    try:
        rows = datasets.load_dataset(corpus.dataset, corpus.name, split=corpus.split,
                                     streaming=True)
    except Exception as e:  # noqa: BLE001 - the hub's, the network's and datasets' errors
        raise CorpusError(f"--dataset {corpus.dataset}: cannot be streamed "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    for n, row in enumerate(rows):
        value = row.get(corpus.column)
        if not isinstance(value, str):
            raise CorpusError(f"--dataset {corpus.dataset}: row {n} has no text field "
                              f"{corpus.column!r} (--column); it has {', '.join(row)}")
        if value.strip():
            yield value

"""Token streams for language-model targets: one fresh batch of fixed-length windows per step.

Every source is one flat stream of token ids; a batch is `batch_size` windows of `seq_len`
consecutive tokens. Three sources (`TokenSpec.source`, config key `data.source`):

``synthetic``
    No file. A small language with something to learn: a fixed bank of ``vocab_size // 4``
    phrases of ``PHRASE_LEN`` ids (drawn uniformly from the vocab, from a seed of their
    own, so every run with the same vocab speaks the same language), and each row is phrases
    picked with Zipf weights (p(phrase k) ∝ 1 / (k + 1)) and put back to back, entered at a
    random offset. Each id sits in several phrases, so predicting the next one takes the
    context of the previous few (attention and MLP memory), while a phrase's first id is
    chance; `synthetic_entropy` is the rate a perfect model reaches.

``tokens`` — a flat binary token file
    The nanoGPT / llm.c convention without a header: the whole file is an array of token
    ids, little-endian, either ``uint16`` (2 bytes each) or ``uint32`` (4 bytes each), as
    named by ``data.token_dtype``. No header, no separators: documents are back to back
    (put an end-of-text id between them if the model expects one). The file size must be a
    multiple of the item size. It is memory-mapped: opening it reads it once, in chunks,
    to check every id; after that a step reads only the windows it draws.
    Write one with `write_tokens`, which also writes the sidecar ``<file>.json`` recording
    the dtype and the id count; a file with a sidecar is checked against it when opened.

``hf_dataset`` — a directory written by ``datasets.Dataset.save_to_disk``
    Its Arrow IPC files (``data-00000-of-00003.arrow``, ...: the stream format
    ``save_to_disk`` writes, or the file format), in the order of their names. Column ``data.column`` (e.g.
    ``input_ids``) holds one list of integer token ids per document (``list<int*>``,
    ``large_list`` or ``fixed_size_list``). The documents, in file then row order, form the
    stream back to back; the files are memory-mapped and indexed in place
    (`ChunkedTokens`), so a dataset larger than memory costs only the windows drawn. A
    ``DatasetDict`` directory (``dataset_dict.json`` with ``{"splits": [...]}`` and one
    sub-directory per split) is read from its ``train`` split. Only pyarrow is needed.

Held out: `TokenStream.split` (config key `data.eval_frac`, default 0.01) keeps the last
fraction of a file stream's tokens for the final evaluation; training windows never
reach into it (a window may not straddle the cut).

Batches: for step `s` the window starts are `batch_size` draws, uniform on
[0, n_tokens - seq_len], from ``np.random.default_rng([seed, s])``. A batch is therefore a
pure function of (seed, step, batch_size): a resumed run sees the batches it would have
seen, and each host can read only its own rows (`rows(s, B, slice(a, b))` draws all B
starts, which is cheap, but reads only rows a..b). Synthetic rows are seeded per row from
[seed, step, row] for the same reason.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pdecomp.core import documents
from pdecomp.core.config import DATA_SOURCES, TOKEN_DTYPES, ConfigError

TOKEN_SOURCES = tuple(s for s in DATA_SOURCES if s != "toy")

# When a stream is opened every id is checked against the vocab, read in chunks of this
# many ids from the memory map (32-64 MiB each, so the check's memory stays flat); every
# batch is checked again as it is read.
_SCAN_CHUNK = 1 << 24
# A uint16 stream with fewer id pairs than this gets no statistical dtype verdict.
_MIN_PAIRS = 64
SIDECAR_FORMAT = "pdecomp tokens"


@dataclass(frozen=True)
class TokenSpec:
    """What to read; built by the caller from the run config."""

    source: str  # one of TOKEN_SOURCES
    path: str  # file (tokens) or directory (hf_dataset); ignored for synthetic
    token_dtype: str  # one of TOKEN_DTYPES; for source=tokens
    column: str  # hf_dataset column holding token ids, e.g. "input_ids"
    seq_len: int
    vocab_size: int  # the model's; every token id must be < this
    seed: int
    documents: bool = True  # read the file's document starts, where it records them


class ChunkedTokens:
    """One flat stream of ids kept as the arrays it lives in (an HF dataset's memory-mapped
    Arrow columns, one per record batch): sliced and read in place, never concatenated."""

    def __init__(self, chunks: list[np.ndarray]):
        self.chunks = [c for c in chunks if len(c)]
        self.starts = np.cumsum([0, *(len(c) for c in self.chunks)])  # chunk i: [s_i, s_i+1)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> ChunkedTokens:
        a, b, step = index.indices(len(self))
        if step != 1:
            raise ValueError("ChunkedTokens takes contiguous slices only")
        out = []
        for c, (lo, hi) in enumerate(zip(self.starts[:-1], self.starts[1:])):
            if hi > a and lo < b:
                out.append(self.chunks[c][max(a - lo, 0):min(b, hi) - lo])
        return ChunkedTokens(out)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """ids [len(starts), length]: the window at each start, across chunk ends."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for i, s in enumerate(starts):
            c = int(np.searchsorted(self.starts, s, side="right")) - 1
            at, filled = int(s - self.starts[c]), 0
            while filled < length:
                piece = self.chunks[c][at:at + length - filled]
                out[i, filled:filled + len(piece)] = piece
                filled, c, at = filled + len(piece), c + 1, 0
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate(self.chunks) if self.chunks else np.empty(0, np.int64)
        return whole if dtype is None else whole.astype(dtype)


@dataclass(frozen=True, eq=False)  # eq would compare arrays elementwise
class TokenStream:
    """A flat token stream (or the synthetic distribution) and the batches drawn from it."""

    spec: TokenSpec
    tokens: np.ndarray | ChunkedTokens | None  # flat ids (memmap, chunks); None: synthetic
    # where each document starts (ascending offsets into `tokens`, the first 0); None: the
    # stream is one document, its windows unflagged
    doc_starts: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        """Tokens in the stream; 0 for synthetic (unbounded)."""
        return 0 if self.tokens is None else len(self.tokens)

    def split(self, eval_frac: float, eval_seed: int) -> tuple[TokenStream, TokenStream]:
        """(train, held out): the last `eval_frac` of a file's tokens are held out, and the
        held-out stream draws its windows from `eval_seed`. Synthetic rows are never reused
        across seeds, so both halves are the whole language. Views: nothing is copied."""
        held_spec = dataclasses.replace(self.spec, seed=eval_seed)
        if self.tokens is None or eval_frac == 0:
            return self, TokenStream(held_spec, self.tokens, self.doc_starts)
        n, L = self.n_tokens, self.spec.seq_len
        cut = n - math.ceil(n * eval_frac)
        if self.doc_starts is not None:  # held out by document: the cut at a start
            at = int(np.searchsorted(self.doc_starts, cut))
            cut = int(self.doc_starts[at]) if at < len(self.doc_starts) else cut
            held_starts = np.unique(np.concatenate([[0], self.doc_starts[at:] - cut]))
        if min(cut, n - cut) < L + 1:
            raise ConfigError("data.eval_frac", eval_frac,
                              f"{self.spec.path} holds {n} tokens; both its training part "
                              f"({cut}) and held-out part ({n - cut}) need seq_len + 1 = "
                              f"{L + 1} (0 evaluates on the training stream)")
        if self.doc_starts is None:
            return TokenStream(self.spec, self.tokens[:cut]), TokenStream(held_spec,
                                                                           self.tokens[cut:])
        return (TokenStream(self.spec, self.tokens[:cut], self.doc_starts[:at]),
                TokenStream(held_spec, self.tokens[cut:], held_starts.astype(np.int64)))

    def rows(self, step: int, batch_size: int, index: slice = slice(None)) -> np.ndarray:
        """int32 [rows in `index`, seq_len]: rows `index` of the global batch of `step`."""
        if step < 0 or batch_size <= 0:
            raise ValueError(f"need step >= 0 and batch_size > 0; got {step=}, {batch_size=}")
        picked = range(batch_size)[index]
        L, seed = self.spec.seq_len, self.spec.seed
        if self.tokens is None:
            phrases, cdf = _phrase_bank(self.spec.vocab_size)
            n_phrases, n = len(phrases), -(-L // PHRASE_LEN) + 1
            out = np.empty((len(picked), L), dtype=np.int32)
            for i, r in enumerate(picked):
                rng = np.random.default_rng([seed, step, r])
                which = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"),
                                   n_phrases - 1)
                start = rng.integers(PHRASE_LEN)
                out[i] = phrases[which].reshape(-1)[start:start + L]
            return out
        starts = window_starts(seed, step, batch_size, self.n_tokens, L)[picked]
        # Either way only the pages of the chosen windows are read.
        if isinstance(self.tokens, ChunkedTokens):
            windows = self.tokens.windows(starts, L)
        else:
            windows = self.tokens[starts[:, None] + np.arange(L)]
        if windows.size:
            lo, hi, V = int(windows.min()), int(windows.max()), self.spec.vocab_size
            if lo < 0 or hi >= V:
                raise ValueError(f"token id {hi if hi >= V else lo} in the batch of step "
                                 f"{step} is outside the model's vocab [0, {V}) (source "
                                 f"{self.spec.path})")
        windows = windows.astype(np.int32)
        return windows if self.doc_starts is None else documents.mark(
            windows, self.starts_in(starts, L))

    def starts_in(self, starts: np.ndarray, length: int) -> np.ndarray:
        """bool [len(starts), length]: where a document starts inside each window (its
        first position not counted: a window starts a segment anyway)."""
        out = np.zeros((len(starts), length), bool)
        for i, s in enumerate(starts):
            lo, hi = np.searchsorted(self.doc_starts, [s + 1, s + length])
            out[i, self.doc_starts[lo:hi] - s] = True
        return out


def window_starts(seed: int, step: int, batch_size: int, n_tokens: int, seq_len: int
                  ) -> np.ndarray:
    """The `batch_size` window starts of `step`, uniform on [0, n_tokens - seq_len]."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len, size=batch_size, endpoint=True)


def open_tokens(spec: TokenSpec, scan: bool = True) -> TokenStream:
    """Check `spec` and open its stream. Raises ConfigError on bad input. Without `scan`,
    what headers and sizes tell only (a submission's check, on a login node): the ids are
    not read."""
    if spec.source not in TOKEN_SOURCES:
        raise ConfigError("data.source", spec.source, f"allowed: {', '.join(TOKEN_SOURCES)}")
    if spec.seq_len <= 0:
        raise ConfigError("data.seq_len", spec.seq_len, "must be > 0")
    if spec.vocab_size <= 0:
        raise ConfigError("model.vocab_size", spec.vocab_size, "must be > 0")
    if spec.seed < 0:  # numpy's SeedSequence takes only non-negative entropy
        raise ConfigError("seed", spec.seed, "must be >= 0")
    if spec.source == "synthetic":
        return TokenStream(spec, None)
    if spec.source == "tokens":
        tokens, rows = _open_flat_file(spec), None
    else:
        tokens, rows = _open_hf_dataset(spec)
    n = len(tokens)
    if n < spec.seq_len + 1:
        raise ConfigError("data.seq_len", spec.seq_len,
                          f"{spec.path} holds {n} tokens; needs at least seq_len + 1")
    starts = (None if not spec.documents else rows if rows is not None
              else _open_starts(spec, n))
    if starts is not None and spec.vocab_size > documents.START:
        raise ConfigError("data.documents", True, f"a vocabulary of {spec.vocab_size} ids "
                          f"leaves no room for the document flag (at most "
                          f"{documents.START}); set data.documents=false")
    if not scan:
        return TokenStream(spec, tokens, starts)
    ids = _scanned(spec, tokens)
    _check_ids(spec, tokens, ids)
    if spec.source == "tokens" and not sidecar_of(Path(spec.path)).is_file():
        _check_not_uint32(spec, n, ids)
    return TokenStream(spec, tokens, starts)


def starts_of(path: Path) -> Path:
    """`<file>.starts` beside a flat token file: where each document starts (little-endian
    uint64 offsets, ascending, the first 0), named by its sidecar."""
    return path.with_name(path.name + ".starts")


def _open_starts(spec: TokenSpec, n: int) -> np.ndarray | None:
    """The document starts a token file's sidecar names (None where it names none)."""
    side = sidecar_of(Path(spec.path))
    record = json.loads(side.read_text()) if side.is_file() else {}
    if not record.get("document_starts"):
        return None
    f = Path(spec.path).with_name(record["document_starts"])
    if not f.is_file() or f.stat().st_size % 8:
        raise ConfigError("data.path", spec.path, f"its sidecar names document starts in "
                          f"{f}, which is missing or not uint64 (data.documents=false reads "
                          "the file as one stream)")
    starts = np.fromfile(f, dtype="<u8").astype(np.int64)
    if not len(starts) or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= n:
        raise ConfigError("data.path", spec.path, f"its document starts {f} are not "
                          f"ascending offsets from 0 below its {n} ids")
    return starts


def sidecar_of(path: Path) -> Path:
    """`<file>.json` beside a flat token file: its dtype and id count, as written."""
    return path.with_name(path.name + ".json")


def write_tokens(path: str | Path, ids: np.ndarray | list[int], token_dtype: str,
                 doc_starts: np.ndarray | list[int] | None = None) -> Path:
    """Write a flat token file (`token_dtype`: one of TOKEN_DTYPES), its sidecar, and where
    its documents start (`doc_starts`, offsets from 0) when given. Ids that the dtype cannot
    hold are refused rather than wrapped."""
    path = Path(path)
    arr = as_token_dtype(ids, token_dtype)
    arr.tofile(path)
    record = None
    if doc_starts is not None:
        np.asarray(doc_starts, "<u8").tofile(starts_of(path))
        record = {"documents": len(doc_starts), "document_starts": starts_of(path).name}
    write_sidecar(path, token_dtype, int(arr.size), record)
    return path


def as_token_dtype(ids: np.ndarray | list[int], token_dtype: str) -> np.ndarray:
    """`ids` as a token file stores them (little-endian `token_dtype`); ids the dtype cannot
    hold are refused (ValueError) rather than wrapped."""
    dtype = np.dtype(token_dtype).newbyteorder("<")
    arr = np.asarray(ids)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(dtype).max):
        raise ValueError(f"ids in [{int(arr.min())}, {int(arr.max())}] do not fit "
                         f"{token_dtype}")
    return arr.astype(dtype)


def write_sidecar(path: Path, token_dtype: str, count: int,
                  record: dict[str, Any] | None = None) -> dict[str, Any]:
    """`path`'s sidecar: its dtype and id count (checked when the file is opened), and
    anything else worth keeping about how it was made (`record`). The sidecar as written."""
    side = {"format": SIDECAR_FORMAT, "dtype": token_dtype, "count": count, **(record or {})}
    sidecar_of(path).write_text(json.dumps(side, indent=1))
    return side


def _check_sidecar(spec: TokenSpec, path: Path, n_bytes: int) -> None:
    """A sidecar, where there is one, must agree with data.token_dtype and the file's size."""
    side = sidecar_of(path)
    if not side.is_file():
        return
    try:
        record = json.loads(side.read_text())
        dtype, count = record["dtype"], int(record["count"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError("data.path", spec.path, f"its sidecar {side} is unreadable "
                          f"(want JSON with dtype and count): {e}") from None
    if dtype != spec.token_dtype:
        raise ConfigError("data.token_dtype", spec.token_dtype,
                          f"{side} records that {spec.path} holds {dtype} ids: set "
                          f"data.token_dtype={dtype}")
    n = n_bytes // np.dtype(dtype).itemsize
    if n != count:
        raise ConfigError("data.path", spec.path, f"holds {n} {dtype} ids; its sidecar {side} "
                          f"records {count} (a truncated or appended file?)")


def _open_flat_file(spec: TokenSpec) -> np.ndarray:
    if spec.token_dtype not in TOKEN_DTYPES:
        raise ConfigError("data.token_dtype", spec.token_dtype,
                          f"allowed: {', '.join(TOKEN_DTYPES)}")
    path = Path(spec.path)
    if not path.is_file():
        raise ConfigError("data.path", spec.path, "no such token file (source=tokens)")
    dtype = np.dtype(spec.token_dtype).newbyteorder("<")
    size = path.stat().st_size
    _check_sidecar(spec, path, size)
    if size % dtype.itemsize:
        raise ConfigError("data.token_dtype", spec.token_dtype,
                          f"{spec.path} has {size} bytes, not a multiple of {dtype.itemsize}")
    if size == 0:  # np.memmap refuses an empty file; the length check reports it
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _open_hf_dataset(spec: TokenSpec) -> tuple[ChunkedTokens, np.ndarray]:
    """The dataset's ids as one stream, and where each of its rows (a document) starts."""
    files = _arrow_files(spec)
    # Flattened columns of the memory-mapped files, as numpy views: nothing is read here
    # but the schema, the batch headers and the rows' offsets. Ids are checked like a flat
    # file's: all of them when the stream is opened, every batch as it is read.
    chunks: list[np.ndarray] = []
    starts, n = [], 0
    for f in files:
        schema, batches = _record_batches(spec, f)
        _check_column(spec, schema)
        for batch in batches:
            column = batch.column(spec.column)
            ids = column.flatten()
            if ids.null_count:
                raise ConfigError("data.column", spec.column, "holds null token ids")
            chunks.append(ids.to_numpy(zero_copy_only=False))
            starts.append(n + _row_starts(column))
            n += len(ids)
    return ChunkedTokens(chunks), np.unique(np.concatenate([[0], *starts])).astype(np.int64)


def _row_starts(column: pa.Array) -> np.ndarray:
    """Where each row of a list column starts in its flattened values (empty rows: none)."""
    if pa.types.is_fixed_size_list(column.type):
        return np.arange(len(column), dtype=np.int64) * column.type.list_size
    offsets = column.offsets.to_numpy().astype(np.int64)
    starts = offsets[:-1] - offsets[0]
    return starts[offsets[1:] > offsets[:-1]]


def _record_batches(spec: TokenSpec, f: Path) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """An Arrow IPC file's schema and batches, memory-mapped: the stream format (what
    `save_to_disk` writes) or the random-access file format (Feather v2)."""
    source = pa.memory_map(str(f), "r")
    try:
        reader = pa.ipc.open_stream(source)
        return reader.schema, iter(reader)
    except pa.ArrowInvalid:
        pass
    try:
        whole = pa.ipc.open_file(source)
    except pa.ArrowInvalid as e:
        raise ConfigError("data.path", spec.path, f"{f.name} is not an Arrow IPC file "
                          f"({e})") from None
    return whole.schema, (whole.get_batch(i) for i in range(whole.num_record_batches))


def _arrow_files(spec: TokenSpec) -> list[Path]:
    """The dataset's Arrow files in order: `save_to_disk` numbers them
    (`data-00000-of-00003.arrow`, ...), so their sorted names are its row order."""
    return sorted(_dataset_dir(spec).glob("*.arrow"))


def _dataset_dir(spec: TokenSpec) -> Path:
    """The directory of the Arrow files: `path` itself, or the train split of a DatasetDict
    (`dataset_dict.json` naming its splits, one directory each)."""
    root = Path(spec.path)
    if not root.is_dir():
        raise ConfigError("data.path", spec.path, "no such directory (source=hf_dataset)")
    if (root / "dataset_dict.json").is_file():
        try:
            splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError("data.path", spec.path,
                              f"unreadable dataset_dict.json ({e})") from e
        if "train" not in splits or not any((root / "train").glob("*.arrow")):
            raise ConfigError("data.path", spec.path, f"a DatasetDict with splits "
                              f"{', '.join(map(str, splits))}; needs a 'train' split")
        return root / "train"
    if any(root.glob("*.arrow")):
        return root
    raise ConfigError("data.path", spec.path, "no .arrow files and no dataset_dict.json: save "
                      "it with datasets' save_to_disk")


def _check_column(spec: TokenSpec, schema: pa.Schema) -> None:
    if spec.column not in schema.names:
        raise ConfigError("data.column", spec.column,
                          f"columns present: {', '.join(schema.names)}")
    t = schema.field(spec.column).type
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    if not (is_list and pa.types.is_integer(t.value_type)):
        raise ConfigError("data.column", spec.column,
                          f"must hold lists of integer token ids; its type is {t}")


@dataclass(frozen=True)
class IdScan:
    """What one pass over a whole stream found: its smallest and largest id and, for a
    uint16 file, the largest id at an odd position (`_check_not_uint32`)."""

    lo: int
    hi: int
    odd_hi: int


def _chunks(tokens: np.ndarray | ChunkedTokens) -> list[np.ndarray]:
    """The stream as views of at most _SCAN_CHUNK ids, each starting at an even position."""
    arrays = tokens.chunks if isinstance(tokens, ChunkedTokens) else [tokens]
    return [a[i:i + _SCAN_CHUNK] for a in arrays for i in range(0, len(a), _SCAN_CHUNK)]


def scan_ids(tokens: np.ndarray | ChunkedTokens) -> IdScan:
    """One streamed pass over every id (a memory map is read a chunk at a time)."""
    lo, hi, odd_hi = 0, 0, 0
    for i, c in enumerate(_chunks(tokens)):
        c_lo, c_hi = int(c.min()), int(c.max())
        lo, hi = (c_lo, c_hi) if i == 0 else (min(lo, c_lo), max(hi, c_hi))
        if c.dtype == np.dtype("<u2") and len(c) >= 2:
            # A pair of uint16 ids read as one little-endian uint32 is even + odd << 16, so
            # the pairs' largest value, shifted, is the largest odd-position id: one
            # contiguous pass, no strided copy.
            pairs = c[:len(c) // 2 * 2].view("<u4")
            odd_hi = max(odd_hi, int(pairs.max()) >> 16)
    return IdScan(lo, hi, odd_hi)


# Scans by the stream's identity on disk (path, sizes, mtimes): a sweep's validation of
# each combination and the job's own open read a file once per process.
_SCANS: dict[tuple, IdScan] = {}


def _scanned(spec: TokenSpec, tokens: np.ndarray | ChunkedTokens) -> IdScan:
    if spec.source == "tokens":
        files = [Path(spec.path)]
    else:
        files = _arrow_files(spec)
    stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    key = (spec.source, spec.token_dtype, spec.column, stats)
    if key not in _SCANS:
        _SCANS[key] = scan_ids(tokens)
    return _SCANS[key]


def _check_ids(spec: TokenSpec, tokens: np.ndarray | ChunkedTokens, scan: IdScan) -> None:
    if scan.lo < 0:
        raise ConfigError("data.path", spec.path, f"holds negative token id {scan.lo}")
    if scan.hi >= spec.vocab_size:
        at = 0
        for c in _chunks(tokens):  # only on the way to the error: where the first one is
            if int(c.max()) >= spec.vocab_size:
                at += int(np.argmax(c >= spec.vocab_size))
                break
            at += len(c)
        hint = "; check data.token_dtype" if spec.source == "tokens" else ""
        raise ConfigError("data.path", spec.path, f"holds token id {scan.hi} >= model vocab "
                          f"size {spec.vocab_size} (the first such id is token {at}){hint}")


def _check_not_uint32(spec: TokenSpec, n: int, scan: IdScan) -> None:
    """Refuse a flat file without a sidecar that looks like uint32 ids read as uint16.

    Read as uint16, a little-endian uint32 file is each id's low half then its high half,
    and a high half is at most (vocab - 1) >> 16 (0 for vocabularies up to 65,536, 1 up to
    131,072). So: every odd-position value at most that bound while some even-position value
    is above it, over at least _MIN_PAIRS pairs. Real uint16 text has its odd positions
    spread over the vocab as much as its even ones, and never passes for this.
    Limits: a genuine uint16 stream whose every other id is tiny (0, or 0/1 above 65,536
    ids) is refused (write it with `write_tokens`: a sidecar's dtype is taken as given);
    a file of under _MIN_PAIRS pairs, or whose ids are all at most the bound, gets no
    verdict. The other mistake, uint16 ids read as uint32 (even + odd x 65,536), needs no
    statistic: such ids exceed any vocab below 65,536 x (largest odd-position id + 1), and
    the vocab check refuses them; an odd count of uint16 ids fails the size check.
    """
    if spec.token_dtype != "uint16" or n % 2 or n // 2 < _MIN_PAIRS:
        return
    bound = (spec.vocab_size - 1) >> 16
    if scan.odd_hi <= bound < scan.hi:
        raise ConfigError("data.token_dtype", spec.token_dtype,
                          f"{spec.path} looks like uint32 ids read as uint16: every id at an "
                          f"odd position is <= {bound} (the high halves of uint32 ids); set "
                          "data.token_dtype=uint32, or write the file with "
                          "pdecomp.targets.data.write_tokens to record its dtype")


PHRASE_LEN = 8  # ids per phrase of the synthetic language
_PHRASE_SEED = 20_250_101  # the language's own seed: the same phrases for every run seed


@functools.lru_cache(maxsize=8)
def _phrase_bank(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The synthetic language: phrases [vocab_size // 4 (at least 2), PHRASE_LEN] and the
    CDF of their Zipf weights."""
    n = max(vocab_size // 4, 2)
    phrases = np.random.default_rng(_PHRASE_SEED).integers(0, vocab_size, (n, PHRASE_LEN))
    cdf = np.cumsum(1.0 / np.arange(1, n + 1, dtype=np.float64))
    return phrases.astype(np.int32), cdf / cdf[-1]


def synthetic_entropy(vocab_size: int) -> float:
    """Nats per token a model that knows every phrase reaches on long rows: the Zipf choice
    of the next phrase, once per PHRASE_LEN ids."""
    cdf = _phrase_bank(vocab_size)[1]
    p = np.diff(cdf, prepend=0.0)
    return float(-(p * np.log(p)).sum() / PHRASE_LEN)

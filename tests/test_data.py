"""Token streams (pdecomp.targets.data): the file formats, batch determinism, and bad-input errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from pdecomp.core import documents
from pdecomp.core.config import ConfigError
from pdecomp.targets import data
from pdecomp.targets.data import ChunkedTokens, TokenSpec, TokenStream, open_tokens, window_starts

SEQ, VOCAB, BATCH = 16, 70_000, 12


def spec(source: str = "tokens", path: str | Path = "", **kw) -> TokenSpec:
    base = TokenSpec(source, str(path), token_dtype="uint16", column="input_ids", seq_len=SEQ,
                     vocab_size=VOCAB, seed=3)
    return dataclasses.replace(base, **kw)


def is_window_of(row: np.ndarray, flat: np.ndarray) -> bool:
    """`row` equals some contiguous window of `flat`."""
    windows = np.lib.stride_tricks.sliding_window_view(flat, len(row))
    return bool((windows == row).all(axis=1).any())


def check_batches(stream: TokenStream, flat: np.ndarray) -> None:
    """Rows are windows of `flat`; a step's batch is fixed, other steps differ; slices agree."""
    assert stream.n_tokens == len(flat)
    b0 = stream.rows(0, BATCH)
    assert b0.shape == (BATCH, SEQ) and b0.dtype == np.int32
    starts = window_starts(3, 0, BATCH, len(flat), SEQ)
    for row, s in zip(b0, starts, strict=True):
        np.testing.assert_array_equal(documents.ids(row), flat[s:s + SEQ])
    assert all(is_window_of(documents.ids(r), flat) for r in stream.rows(5, BATCH))
    np.testing.assert_array_equal(stream.rows(0, BATCH), b0)
    assert not np.array_equal(stream.rows(1, BATCH), b0)
    full = stream.rows(7, BATCH)
    for sl in (slice(0, 4), slice(4, 12), slice(10, None), slice(3, 3)):
        np.testing.assert_array_equal(stream.rows(7, BATCH, sl), full[sl])


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_flat_file_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    # uint32 ids above 65535 show the file is read as 4-byte items, not pairs of uint16.
    high = 60_000 if dtype == "uint16" else VOCAB
    flat = rng.integers(0, high, size=5_000).astype(np.dtype(dtype).newbyteorder("<"))
    path = tmp_path / "train.bin"
    flat.tofile(path)
    stream = open_tokens(spec("tokens", path, token_dtype=dtype))
    check_batches(stream, flat.astype(np.int64))
    if dtype == "uint32":
        assert stream.rows(0, BATCH).max() > 65_535


def test_window_starts_cover_both_ends():
    starts = window_starts(0, 0, 2_000, n_tokens=SEQ + 2, seq_len=SEQ)
    assert set(starts.tolist()) == {0, 1, 2}


def save_docs(tmp_path: Path, docs: list[list[int]], *, as_dict: bool = False,
              shards: int = 1) -> Path:
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_dict({"input_ids": docs, "text": [str(len(d)) for d in docs]})
    out = tmp_path / "ds"
    if as_dict:
        dd = DatasetDict({"train": ds, "validation": ds.select([0])})
        dd.save_to_disk(out, num_shards={"train": shards, "validation": 1})
    else:
        ds.save_to_disk(out, num_shards=shards)
    return out


def random_docs(n: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, VOCAB, size=rng.integers(1, 60)).tolist() for _ in range(n)]


@pytest.mark.parametrize(("as_dict", "shards"), [(False, 1), (True, 3)])
def test_hf_dataset_is_the_concatenated_documents(tmp_path, as_dict, shards):
    docs = random_docs()
    path = save_docs(tmp_path, docs, as_dict=as_dict, shards=shards)
    if shards > 1:  # the order across files is exercised
        assert len(list((path / "train").glob("data-*.arrow"))) == shards
    stream = open_tokens(spec("hf_dataset", path))
    flat = np.concatenate([np.asarray(d) for d in docs])
    np.testing.assert_array_equal(stream.tokens, flat)
    check_batches(stream, flat)
    # each row a document: the stream knows where each starts (data.documents)
    np.testing.assert_array_equal(stream.doc_starts,
                                  np.cumsum([0, *(len(d) for d in docs[:-1])]))
    assert open_tokens(spec("hf_dataset", path, documents=False)).doc_starts is None


def test_hf_dataset_reads_arrow_files_in_the_random_access_format_too(tmp_path):
    """Arrow written by other tools (pyarrow's own writer, Feather v2) rather than
    save_to_disk: its files in the order of their names, whatever their IPC format."""
    import pyarrow as pa

    docs = random_docs()
    for k, part in enumerate((docs[:25], docs[25:])):
        table = pa.table({"input_ids": pa.array(part, pa.list_(pa.int32()))})
        with pa.ipc.new_file(str(tmp_path / f"part-{k}.arrow"), table.schema) as w:
            w.write_table(table, max_chunksize=7)
    stream = open_tokens(spec("hf_dataset", tmp_path))
    np.testing.assert_array_equal(stream.tokens, np.concatenate([np.asarray(d) for d in docs]))


def test_synthetic_is_deterministic_and_learnable():
    s = open_tokens(spec("synthetic", vocab_size=1_000))
    assert s.n_tokens == 0
    b = s.rows(4, BATCH)
    assert b.shape == (BATCH, SEQ) and b.dtype == np.int32
    assert b.min() >= 0 and b.max() < 1_000
    np.testing.assert_array_equal(s.rows(4, BATCH), b)
    assert not np.array_equal(s.rows(5, BATCH), b)
    np.testing.assert_array_equal(s.rows(4, BATCH, slice(5, 9)), b[5:9])
    other_seed = open_tokens(spec("synthetic", vocab_size=1_000, seed=4))
    assert not np.array_equal(other_seed.rows(4, BATCH), b)

    # A language, not noise: the previous two ids fix the next one except at a phrase
    # boundary (1 in PHRASE_LEN), while the previous id alone often does not.
    rows = s.rows(0, 512)
    def predictable(context: int) -> float:
        seen: dict[tuple, dict[int, int]] = {}
        for r in rows:
            for t in range(context, len(r)):
                nxt = seen.setdefault(tuple(r[t - context:t]), {})
                nxt[r[t]] = nxt.get(r[t], 0) + 1
        return sum(max(v.values()) for v in seen.values()) / sum(
            sum(v.values()) for v in seen.values())
    boundary = 1 / data.PHRASE_LEN
    assert predictable(2) > 1 - boundary - 0.05
    assert predictable(1) < predictable(2) - 0.05
    # The rate a perfect model reaches is well below an unpredictable stream's log(V).
    assert 0 < data.synthetic_entropy(1_000) < 0.2 * np.log(1_000)


def test_chunked_tokens_read_like_one_flat_array():
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 100, size=n) for n in (5, 0, 1, 17, 3, 0, 30, 2)]
    flat = np.concatenate(chunks)
    tokens = ChunkedTokens(chunks)
    assert len(tokens) == len(flat)
    starts = np.arange(len(flat) - 9)  # every window of 9, many across chunk ends
    np.testing.assert_array_equal(tokens.windows(starts, 9),
                                  flat[starts[:, None] + np.arange(9)])
    for a, b in ((0, 58), (3, 27), (6, 7), (40, 40), (-10, None)):
        part = tokens[a:b]
        np.testing.assert_array_equal(np.asarray(part), flat[a:b])
        if len(part) > 4:
            np.testing.assert_array_equal(part.windows(np.array([0, len(part) - 4]), 4),
                                          [flat[a:b][:4], flat[a:b][-4:]])


def test_hf_dataset_is_read_in_place(tmp_path):
    docs = random_docs(200)
    stream = open_tokens(spec("hf_dataset", save_docs(tmp_path, docs, shards=4)))
    # views of the memory-mapped files: no copy of the dataset is held
    assert len(stream.tokens.chunks) >= 4
    assert not any(c.flags.owndata for c in stream.tokens.chunks)
    train, held = stream.split(0.25, eval_seed=5)
    flat = np.concatenate([np.asarray(d) for d in docs])
    # held out from the first document that starts at or after the last quarter's cut
    starts = np.cumsum([0, *(len(d) for d in docs[:-1])])
    cut = starts[starts >= len(flat) - int(np.ceil(len(flat) * 0.25))][0]
    np.testing.assert_array_equal(np.asarray(train.tokens), flat[:cut])
    np.testing.assert_array_equal(np.asarray(held.tokens), flat[cut:])
    assert all(is_window_of(documents.ids(r), flat[cut:]) for r in held.rows(0, BATCH))


def test_held_out_tail_is_never_trained_on(tmp_path):
    path = tmp_path / "t.bin"
    flat = np.arange(1000, dtype="<u2")  # id = position: a row shows where it was read
    flat.tofile(path)
    train, held = open_tokens(spec("tokens", path)).split(0.1, eval_seed=99)
    assert train.n_tokens == 900 and held.n_tokens == 100 and held.spec.seed == 99
    seen_train = np.concatenate([train.rows(i, 64) for i in range(50)])
    seen_held = np.concatenate([held.rows(i, 64) for i in range(50)])
    assert seen_train.max() < 900 and seen_held.min() >= 900
    assert seen_train.max() > 850 and seen_held.max() > 980  # both parts are read to the end
    np.testing.assert_array_equal(train.rows(3, 8), train.rows(3, 8))
    whole, same = open_tokens(spec("tokens", path)).split(0.0, eval_seed=99)
    assert whole.n_tokens == same.n_tokens == 1000
    synthetic, synthetic_held = open_tokens(spec("synthetic", vocab_size=64)).split(0.5, 99)
    assert not np.array_equal(synthetic.rows(0, 4), synthetic_held.rows(0, 4))
    with pytest.raises(ConfigError, match="data.eval_frac") as e:
        open_tokens(spec("tokens", path)).split(0.01, eval_seed=99)  # 10 tokens < SEQ + 1
    assert "held-out part (10)" in str(e.value)


def test_document_starts_flag_windows_and_hold_out_by_document(tmp_path):
    """A file with its documents' starts: each window is flagged where a document starts
    inside it (not at its own first position), ids unchanged under the flags; the held-out
    part begins at a document; data.documents=false and a file without starts read it as
    one stream; starts that are not ascending offsets from 0 are refused in one line."""
    path = tmp_path / "t.bin"
    flat = np.arange(1000) % 700  # ids that say where they were read
    doc_starts = np.array([0, 5, 37, 38, 400, 893, 950])
    data.write_tokens(path, flat, "uint16", doc_starts)
    stream = open_tokens(spec("tokens", path))
    rows = stream.rows(2, BATCH)
    starts = window_starts(3, 2, BATCH, 1000, SEQ)
    for row, s in zip(rows, starts, strict=True):
        np.testing.assert_array_equal(documents.ids(row), flat[s:s + SEQ])
        inside = [d - s for d in doc_starts if s < d < s + SEQ]
        assert np.flatnonzero(row & documents.START).tolist() == inside
    train, held = stream.split(0.1, eval_seed=99)  # the cut at 900 moves to 950
    assert (train.n_tokens, held.n_tokens) == (950, 50)
    assert train.doc_starts.tolist() == [0, 5, 37, 38, 400, 893]
    assert held.doc_starts.tolist() == [0]
    plain = open_tokens(spec("tokens", path, documents=False))
    assert plain.doc_starts is None
    np.testing.assert_array_equal(plain.rows(2, BATCH), documents.ids(rows))
    (tmp_path / "old.bin").write_bytes(path.read_bytes())  # no sidecar: an older file
    assert open_tokens(spec("tokens", tmp_path / "old.bin")).doc_starts is None
    np.array([0, 37, 5], "<u8").tofile(data.starts_of(path))
    with pytest.raises(ConfigError, match="not ascending offsets from 0 below its 1000 ids"):
        open_tokens(spec("tokens", path))


def test_data_documents_reaches_the_runs_token_stream(tmp_path):
    """The run's `data.documents` decides, through the language-model kind's stream, whether
    a file that records its documents is read by document."""
    from pdecomp.core.config import DataConfig, LlamaModelConfig
    from pdecomp.kinds.language_model import token_stream

    path = data.write_tokens(tmp_path / "t.bin", np.arange(1000) % 60, "uint16", [0, 300, 700])
    model = LlamaModelConfig(name="t", vocab_size=64, d_embed=8, n_layers=1, d_mlp=8,
                             n_heads=2, n_kv_heads=1)
    cfg = DataConfig(batch_size=2, source="tokens", path=str(path), seq_len=SEQ,
                     eval_frac=0.0)
    assert token_stream(model, cfg, 0).doc_starts.tolist() == [0, 300, 700]
    assert token_stream(model, dataclasses.replace(cfg, documents=False), 0).doc_starts is None


def test_batch_with_out_of_range_id_raises(tmp_path):
    # Opening checks every id; each batch is checked again as it is read (a stream built
    # around ids the open never checked against this vocab).
    path = tmp_path / "t.bin"
    np.full(SEQ * 4, 500, dtype="<u2").tofile(path)
    stream = open_tokens(spec("tokens", path))
    small = TokenStream(spec("tokens", path, vocab_size=100), stream.tokens)
    with pytest.raises(ValueError, match="token id 500"):
        small.rows(0, 2)


def write(path: Path, ids, dtype: str = "<u2") -> Path:
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def make_bad(tmp_path: Path, case: str) -> TokenSpec:
    ok = np.arange(100) % 50
    if case == "missing file":
        return spec("tokens", tmp_path / "nope.bin")
    if case == "odd size":
        path = tmp_path / "t.bin"
        path.write_bytes(b"\x01\x00" * 7)
        return spec("tokens", path, token_dtype="uint32")
    if case == "too short":
        return spec("tokens", write(tmp_path / "t.bin", np.arange(SEQ)))
    if case == "empty":
        return spec("tokens", write(tmp_path / "t.bin", []))
    if case == "id >= vocab":
        return spec("tokens", write(tmp_path / "t.bin", [*ok, 60_000]), vocab_size=50)
    if case == "bad dtype":
        return spec("tokens", write(tmp_path / "t.bin", ok), token_dtype="int8")
    if case == "bad source":
        return spec("parquet", tmp_path)
    if case == "missing dir":
        return spec("hf_dataset", tmp_path / "nope")
    if case == "no arrow files":
        return spec("hf_dataset", tmp_path)
    if case == "not arrow":
        (tmp_path / "data-00000-of-00001.arrow").write_bytes(b"not arrow at all")
        return spec("hf_dataset", tmp_path)
    if case == "hf column missing":
        return spec("hf_dataset", save_docs(tmp_path, random_docs()), column="tokens")
    if case == "hf column not ids":
        return spec("hf_dataset", save_docs(tmp_path, random_docs()), column="text")
    if case == "hf too short":
        return spec("hf_dataset", save_docs(tmp_path, [[1, 2], [3]]))
    if case == "hf id >= vocab":
        return spec("hf_dataset", save_docs(tmp_path, [[1] * 40, [2, 99]]), vocab_size=50)
    if case == "hf no train split":
        from datasets import Dataset, DatasetDict

        ds = Dataset.from_dict({"input_ids": random_docs()})
        DatasetDict({"test": ds}).save_to_disk(tmp_path / "dd")
        return spec("hf_dataset", tmp_path / "dd")
    raise AssertionError(case)


@pytest.mark.parametrize(("case", "key", "words"), [
    ("missing file", "data.path", "no such token file"),
    ("odd size", "data.token_dtype", "14 bytes"),
    ("too short", "data.seq_len", "holds 16 tokens"),
    ("empty", "data.seq_len", "holds 0 tokens"),
    ("id >= vocab", "data.path", "token id 60000 >= model vocab size 50"),
    ("bad dtype", "data.token_dtype", "uint16, uint32"),
    ("bad source", "data.source", "synthetic, tokens, hf_dataset"),
    ("missing dir", "data.path", "no such directory"),
    ("no arrow files", "data.path", "no .arrow files"),
    ("not arrow", "data.path", "data-00000-of-00001.arrow is not an Arrow IPC file"),
    ("hf column missing", "data.column", "columns present: input_ids, text"),
    ("hf column not ids", "data.column", "lists of integer token ids"),
    ("hf too short", "data.seq_len", "holds 3 tokens"),
    ("hf id >= vocab", "data.path", "token id 99 >= model vocab size 50"),
    ("hf no train split", "data.path", "splits test; needs a 'train' split"),
])
def test_bad_input_raises_config_error(tmp_path, case, key, words):
    bad = make_bad(tmp_path, case)
    with pytest.raises(ConfigError) as e:
        open_tokens(bad)
    assert e.value.key == key
    assert words in str(e.value)
    assert "\n" not in str(e.value)


# -- the whole stream's ids and the file's dtype, checked when it is opened ------------------


@pytest.mark.parametrize("chunk", [1 << 10, data._SCAN_CHUNK])
def test_an_id_beyond_the_vocab_anywhere_in_the_file_is_refused(tmp_path, monkeypatch, chunk):
    """Far past the first million ids, and across chunk ends of the streamed scan."""
    monkeypatch.setattr(data, "_SCAN_CHUNK", chunk)
    ids = np.random.default_rng(0).integers(0, 1_000, size=1_300_000)
    ids[1_234_567] = 1_000
    path = data.write_tokens(tmp_path / "t.bin", ids, "uint16")
    with pytest.raises(ConfigError, match=r"token id 1000 >= model vocab size 1000 \(the first "
                                          r"such id is token 1234567\)") as e:
        open_tokens(spec("tokens", path, vocab_size=1_000))
    assert e.value.key == "data.path" and "\n" not in str(e.value)
    ids[1_234_567] = 999  # rewritten (one id longer): the old file's scan is not reused
    data.write_tokens(path, [*ids, 5], "uint16")
    assert open_tokens(spec("tokens", path, vocab_size=1_000)).n_tokens == len(ids) + 1


def test_a_submission_checks_headers_and_sizes_and_leaves_the_ids_to_the_job(tmp_path,
                                                                              monkeypatch):
    """Opened without `scan` (where `pdecomp cluster=slurm` submits), a token file's size,
    sidecar and length are checked and not one id is read; the job's scan then refuses the
    id beyond the vocab."""
    ids = np.random.default_rng(0).integers(0, 1_000, size=10_000)
    ids[9_000] = 1_000
    path = data.write_tokens(tmp_path / "t.bin", ids, "uint16")

    def no_scan(*args):
        raise AssertionError("the ids were read")

    with monkeypatch.context() as m:
        m.setattr(data, "scan_ids", no_scan)
        assert open_tokens(spec("tokens", path, vocab_size=1_000), scan=False).n_tokens == 10_000
        with pytest.raises(ConfigError, match="data.token_dtype"):  # the sidecar disagrees
            open_tokens(spec("tokens", path, token_dtype="uint32", vocab_size=1_000), scan=False)
    with pytest.raises(ConfigError, match="token id 1000 >= model vocab size 1000"):
        open_tokens(spec("tokens", path, vocab_size=1_000))


def test_an_id_beyond_the_vocab_in_a_later_dataset_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_SCAN_CHUNK", 64)
    docs = [[1] * 50 for _ in range(40)] + [[2] * 30 + [77]]
    with pytest.raises(ConfigError, match=r"token id 77 >= model vocab size 50 \(the first such "
                                          r"id is token 2030\)"):
        open_tokens(spec("hf_dataset", save_docs(tmp_path, docs, shards=3), vocab_size=50))


@pytest.mark.parametrize("vocab", [32_000, 128_256])
def test_uint32_ids_read_as_uint16_without_a_sidecar_are_refused(tmp_path, vocab):
    """For a vocab above 65,535 the vocab check cannot see it: the high halves give it away."""
    ids = np.random.default_rng(1).integers(0, vocab, size=4_000)
    path = tmp_path / "t.bin"
    ids.astype("<u4").tofile(path)  # written by another tool: no sidecar
    with pytest.raises(ConfigError, match="looks like uint32 ids read as uint16") as e:
        open_tokens(spec("tokens", path, vocab_size=vocab))
    assert e.value.key == "data.token_dtype" and "data.token_dtype=uint32" in str(e.value)
    assert open_tokens(spec("tokens", path, token_dtype="uint32", vocab_size=vocab)).n_tokens \
        == len(ids)


def test_uint16_ids_read_as_uint32_fail_the_vocab_check(tmp_path):
    ids = np.random.default_rng(2).integers(0, 32_000, size=4_000)
    path = tmp_path / "t.bin"
    ids.astype("<u2").tofile(path)
    with pytest.raises(ConfigError, match="check data.token_dtype"):
        open_tokens(spec("tokens", path, token_dtype="uint32", vocab_size=32_000))


def test_a_sidecar_names_the_dtype_and_the_count(tmp_path):
    ids = np.random.default_rng(3).integers(0, 50_000, size=3_000)
    path = data.write_tokens(tmp_path / "t.bin", ids, "uint32")
    assert json.loads(data.sidecar_of(path).read_text()) == {
        "format": "pdecomp tokens", "dtype": "uint32", "count": 3_000}
    with pytest.raises(ConfigError, match=r"records that .* holds uint32 ids: set "
                                          r"data.token_dtype=uint32") as e:
        open_tokens(spec("tokens", path, vocab_size=50_000))
    assert e.value.key == "data.token_dtype"
    with path.open("ab") as f:  # appended to after the sidecar was written
        f.write(b"\x00" * 8)
    with pytest.raises(ConfigError, match="holds 3002 uint32 ids; its sidecar .* records 3000"):
        open_tokens(spec("tokens", path, token_dtype="uint32", vocab_size=50_000))
    data.sidecar_of(path).write_text("{")
    with pytest.raises(ConfigError, match="sidecar .* is unreadable"):
        open_tokens(spec("tokens", path, token_dtype="uint32", vocab_size=50_000))


def test_a_sidecar_lets_a_stream_with_tiny_odd_ids_through(tmp_path):
    """The statistical check's one false alarm (every other id 0) is what a sidecar is for."""
    ids = np.zeros(2_000, dtype=np.int64)
    ids[::2] = np.random.default_rng(4).integers(1, 1_000, size=1_000)
    path = tmp_path / "t.bin"
    ids.astype("<u2").tofile(path)
    with pytest.raises(ConfigError, match="looks like uint32"):
        open_tokens(spec("tokens", path, vocab_size=1_000))
    data.write_tokens(path, ids, "uint16")
    assert open_tokens(spec("tokens", path, vocab_size=1_000)).n_tokens == 2_000


def test_write_tokens_refuses_ids_the_dtype_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="do not fit uint16"):
        data.write_tokens(tmp_path / "t.bin", [1, 70_000], "uint16")
    assert not (tmp_path / "t.bin").exists()

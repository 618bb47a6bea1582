"""`pdecomp convert` and `pdecomp tokenize`: GGUF files written here, as llama.cpp's converter
writes them (its tensor names, its q/k row order, rope_freqs for llama3 scaling), from the
transformers fixtures; converted back, they give the fixtures' logits. Every refusal is one
line, exit 2, and leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from launcher.commands import convert, tokenize
from pdecomp.targets import data, from_gguf, text
from pdecomp.targets.hf_checkpoint import load_config, load_hf

FIXTURES = Path(__file__).parent / "fixtures" / "llama"
Q = gguf.GGMLQuantizationType

# Hugging Face -> llama.cpp names (its convert_hf_to_gguf's tensor map).
LAYER = {"input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight",
         **{f"self_attn.{p}_proj.{w}": f"attn_{g}.{w}" for p, g in
            (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for w in ("weight", "bias")},
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
          "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def hf_tensors(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{LAYER[rest]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (each head's rotary halves interleaved)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# A byte-level BPE small enough to write by hand and to fit the fixtures' 128 ids: GPT-2's
# byte alphabet for printable ASCII, space (Ġ) and newline (Ċ), and a few merges.
def byte_alphabet() -> list[str]:
    return [chr(b) for b in range(33, 127)] + [chr(256 + 32), chr(256 + 10)]


MERGES = ["t h", "th e", "Ġ th", "Ġth e", "i n", "Ġ a", "Ġa n", "Ġan d"]
SPECIALS = ["<|endoftext|>", "<|im_start|>"]


def vocab() -> tuple[list[str], list[int]]:
    tokens = byte_alphabet() + [m.replace(" ", "") for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, types


def write_gguf(src: Path, dest: Path, qtype: Q = Q.F32, arch: str | None = None,
               pre: str = "smollm", drop: str | None = None) -> dict[str, np.ndarray]:
    """`src` (a fixture) as llama.cpp writes it; the float32 weights the GGUF holds once its
    quantization is undone, by Hugging Face name."""
    cfg = load_config(src)
    arch = arch or json.loads((src / "config.json").read_text())["model_type"]
    w = gguf.GGUFWriter(str(dest), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.d_head)
    w.add_value_length(cfg.d_head)
    w.add_rope_dimension_count(cfg.d_head)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens, types = vocab()
    tokens = (tokens + [f"<extra_{i}>" for i in range(cfg.vocab_size)])[:cfg.vocab_size]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types((types + [1] * cfg.vocab_size)[:cfg.vocab_size])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    held: dict[str, np.ndarray] = {}
    for name, t in hf_tensors(src).items():
        if name == drop:
            continue
        t = t.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            t = permute(t, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute(t, cfg.num_key_value_heads)
        if t.ndim == 2 and qtype != Q.F32:
            q = gguf.quants.quantize(t, qtype)
            w.add_tensor(gguf_name(name), q, raw_dtype=qtype)
            t = gguf.quants.dequantize(q, qtype)
        else:
            w.add_tensor(gguf_name(name), t)
        held[name] = t
    if cfg.rope_scaling:  # llama.cpp keeps llama3 scaling as per-frequency divisors
        inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.d_head, 2) / cfg.d_head)
        w.add_tensor("rope_freqs.weight",
                     from_gguf.llama3_divisors(inv_freq, cfg.rope_scaling).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def logits(path: Path) -> np.ndarray:
    """The converted model's logits on the tokens of the fixture of the same name."""
    tokens = np.load(FIXTURES / path.name / "tokens.npy")
    return np.asarray(jax.jit(lambda m, t: m(t))(load_hf(path), tokens))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", ["gqa_llama3", "tied_sharded", "llama_bias", "qwen2_bias",
                                  "qwen3_qknorm"])
def test_a_float32_gguf_converts_to_the_fixtures_weights_and_logits(tmp_path, name):
    """GQA with llama3 RoPE scaling, a tied head, attention biases (permuted like q/k's
    rows), a qwen2 (not permuted) and a qwen3 (QK-norm gains, a head_dim of its own): the
    weights exactly, the logits as the loader's."""
    src = FIXTURES / name
    write_gguf(src, tmp_path / "m.gguf")
    out = from_gguf.convert(tmp_path / "m.gguf", tmp_path / name)
    got, want = hf_tensors(out), hf_tensors(src)
    cfg = load_config(src)
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k].astype(np.float32), err_msg=k)
    converted, original = load_config(out), cfg
    for field in ("num_hidden_layers", "hidden_size", "intermediate_size",
                  "num_attention_heads", "num_key_value_heads", "d_head", "rope_theta",
                  "tie_word_embeddings", "vocab_size", "bias", "qk_norm"):
        assert getattr(converted, field) == getattr(original, field), field
    model_type = json.loads((src / "config.json").read_text())["model_type"]
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    if original.rope_scaling:  # recovered from rope_freqs: the same divisors
        inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.d_head, 2) / cfg.d_head)
        np.testing.assert_allclose(
            from_gguf.llama3_divisors(inv_freq, converted.rope_scaling),
            from_gguf.llama3_divisors(inv_freq, original.rope_scaling), rtol=1e-6)
    assert rel_err(logits(out), np.load(src / "logits.npy")) <= 1e-5


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.F16, Q.BF16])
def test_a_quantized_gguf_converts_to_its_dequantized_weights(tmp_path, qtype):
    """Quantized matrices come back as the gguf package dequantizes them (then unpermuted):
    exactly; the logits within the quantization's error."""
    src = FIXTURES / "gqa_llama3"
    held = write_gguf(src, tmp_path / "m.gguf", qtype)
    out = from_gguf.convert(tmp_path / "m.gguf", tmp_path / "gqa_llama3")
    cfg = load_config(src)
    got = hf_tensors(out)
    for k, v in held.items():
        heads = (cfg.num_attention_heads if ".q_proj." in k else
                 cfg.num_key_value_heads if ".k_proj." in k else None)
        want = from_gguf.unpermute_rows(v, heads) if heads else v
        np.testing.assert_array_equal(got[k], want.astype(np.float32), err_msg=k)
    # the tiny random fixture quantizes badly (4 bits: 40% of the largest logit); the
    # weights above are the exact check, these bounds only catch a gross error
    tolerance = {Q.Q8_0: 0.06, Q.Q4_1: 0.6, Q.F16: 2e-3, Q.BF16: 2e-2}[qtype]
    assert rel_err(logits(out), np.load(src / "logits.npy")) <= tolerance


def test_the_gguf_tokenizer_becomes_a_tokenizer_json(tmp_path):
    write_gguf(FIXTURES / "tied_sharded", tmp_path / "m.gguf")
    out = from_gguf.convert(tmp_path / "m.gguf", tmp_path / "m")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    s = "the band and 2024 in <|im_start|>them"
    enc = tok.encode(s)
    # merges applied, digits one by one (smollm), the control token whole and special
    assert enc.tokens[:3] == ["the", "Ġb", "an"] or "the" in enc.tokens
    assert "Ġand" in enc.tokens and ["2", "0", "2", "4"] == [t for t in enc.tokens
                                                            if t.isdigit()]
    assert "<|im_start|>" in enc.tokens
    assert tok.decode(enc.ids, skip_special_tokens=False) == s
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)


def test_the_llama3_and_qwen2_pre_tokenizers_split_as_their_models_do(tmp_path):
    s = "It's 12345 apples,\n\nand  more"
    pieces = {}
    for pre in ("llama-bpe", "qwen2", "gpt-2"):
        write_gguf(FIXTURES / "tied_sharded", tmp_path / f"{pre}.gguf", pre=pre)
        tok = from_gguf.plan(tmp_path / f"{pre}.gguf").tokenizer
        pieces[pre] = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(s)]
        assert tok.decode(tok.encode(s).ids) == s
    assert "123" in pieces["llama-bpe"] and "45" in pieces["llama-bpe"]  # up to 3 digits
    assert all(len(p.strip("Ġ")) <= 1 for p in pieces["qwen2"] if p.strip("Ġ").isdigit())
    assert "Ġ12345" in pieces["gpt-2"]


def _refused(capsys, argv: list[str], words: str, parent: Path) -> None:
    before = sorted(parent.iterdir())
    assert convert.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert sorted(parent.iterdir()) == before  # nothing written, no partial directory


def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    src = FIXTURES / "tied_sharded"
    good = tmp_path / "m.gguf"
    write_gguf(src, good)
    out = str(tmp_path / "out")
    write_gguf(src, tmp_path / "gpt2.gguf", arch="gpt2")
    _refused(capsys, [str(tmp_path / "gpt2.gguf"), out], "general.architecture='gpt2'",
             tmp_path)
    (tmp_path / "text.gguf").write_text("not a model\n")
    _refused(capsys, [str(tmp_path / "text.gguf"), out], "not a GGUF file", tmp_path)
    raw = good.read_bytes()
    for cut in (len(raw) - 1000, 200):  # inside the tensor data; inside the metadata
        (tmp_path / "cut.gguf").write_bytes(raw[:cut])
        _refused(capsys, [str(tmp_path / "cut.gguf"), out], "cut.gguf", tmp_path)
    _refused(capsys, [str(tmp_path / "missing.gguf"), out], "no such file", tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    _refused(capsys, [str(good), str(tmp_path / "full")], "not an empty directory", tmp_path)
    _refused(capsys, [str(good), str(tmp_path / "full" / "keep")], "not an empty directory",
             tmp_path)
    # a type the gguf package cannot dequantize (Q8_1: llama.cpp's activations type)
    w = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 40), np.uint8), raw_dtype=Q.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(capsys, [str(tmp_path / "q81.gguf"), out], "Q8_1", tmp_path)
    write_gguf(src, tmp_path / "spm.gguf", pre="jais")
    _refused(capsys, [str(tmp_path / "spm.gguf"), out], "tokenizer.ggml.pre='jais'", tmp_path)
    # an empty directory is taken
    (tmp_path / "empty").mkdir()
    assert convert.main([str(good), str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "config.json").is_file()


def test_tokenize_writes_documents_with_eos_that_the_token_reader_takes(tmp_path, capsys):
    write_gguf(FIXTURES / "tied_sharded", tmp_path / "m.gguf")
    model = from_gguf.convert(tmp_path / "m.gguf", tmp_path / "m")
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("the band and the\n\nin them")
    (corpus / "sub" / "b.txt").write_text("and the 42")
    (corpus / "skip.rst").write_text("not taken: not *.txt")
    out = tmp_path / "tokens.bin"
    assert tokenize.main([str(corpus), "--model", str(model), "-o", str(out)]) == 0
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    want = [*tok.encode("the band and the\n\nin them").ids, 1, *tok.encode("and the 42").ids, 1]
    ids = np.fromfile(out, np.uint16)
    assert ids.tolist() == want
    side = json.loads(data.sidecar_of(out).read_text())
    assert side["dtype"] == "uint16" and side["count"] == len(want)
    assert side["document_starts"] == "tokens.bin.starts" and side["documents"] == 2
    second = len(tok.encode("the band and the\n\nin them").ids) + 1
    assert np.fromfile(data.starts_of(out), "<u8").tolist() == [0, second]
    stream = data.open_tokens(data.TokenSpec(source="tokens", path=str(out), token_dtype="uint16",
                                             column="", seq_len=4, vocab_size=128, seed=0))
    assert stream.n_tokens == len(want) and stream.doc_starts.tolist() == [0, second]
    assert f"{len(want)} tokens (uint16) from 2 documents" in capsys.readouterr().err
    # paragraphs as documents, shuffled with a seed: the same multiset, reproducibly
    outs = []
    for k in range(2):
        o = tmp_path / f"p{k}.bin"
        assert tokenize.main([str(corpus / "a.txt"), str(corpus / "sub" / "b.txt"), "--model",
                          str(model), "-o", str(o), "--paragraphs", "--seed", "3"]) == 0
        outs.append(np.fromfile(o, np.uint16).tolist())
    assert outs[0] == outs[1] and outs[0].count(1) == 3 and sorted(outs[0]) == sorted(
        [*tok.encode("the band and the").ids, 1, *tok.encode("in them").ids, 1,
         *tok.encode("and the 42").ids, 1])


def _tokenize_rss(args: list[str]) -> int:
    """`pdecomp tokenize args` in a fresh interpreter: its exit code must be 0; the most
    memory it held at once (peak RSS, bytes)."""
    import subprocess
    import sys

    # VmHWM: this program's own peak (getrusage's maxrss would include the forking parent's,
    # which Linux carries across exec).
    code = ("import re, sys; from launcher.commands import tokenize; rc = tokenize.main(sys.argv[1:]); "
            "status = open('/proc/self/status').read(); "
            "print(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1)); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1]) * 1024


@pytest.mark.slow
def test_tokenize_streams_a_corpus_larger_than_its_memory_allowance(tmp_path):
    """A Parquet corpus of 20 MB of text is tokenized holding at most 8 MB more than one of
    a quarter of its size: the memory is bounded, not grown with the corpus (an in-memory
    pass holds the text: +15 MB and more here); its ids are those of encoding each document
    as the tokenizer's template says, followed by EOS; the same documents as JSON Lines give
    the same ids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_gguf(FIXTURES / "tied_sharded", tmp_path / "m.gguf")
    model = from_gguf.convert(tmp_path / "m.gguf", tmp_path / "m")
    words = np.array(["the", "band", "and", "in", "them", "42", "the band"])
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, 90)) for _ in range(50_000)]
    assert sum(map(len, docs)) > 20e6
    pq.write_table(pa.table({"id": np.arange(len(docs)), "text": docs}), tmp_path / "big.parquet",
                   row_group_size=5000)
    pq.write_table(pa.table({"text": docs[:len(docs) // 4]}), tmp_path / "small.parquet",
                   row_group_size=5000)
    with (tmp_path / "big.jsonl").open("w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[:3000])
    base = _tokenize_rss([str(tmp_path / "small.parquet"), "--model", str(model),
                          "-o", str(tmp_path / "small.bin")])
    peak = _tokenize_rss([str(tmp_path / "big.parquet"), "--model", str(model),
                          "-o", str(tmp_path / "big.bin")])
    # Shuffled, the documents are held in memory: the same measure sees them.
    held = _tokenize_rss([str(tmp_path / "big.parquet"), "--model", str(model),
                          "-o", str(tmp_path / "held.bin"), "--seed", "0"])
    print(f"peak RSS {base / 2**20:.1f} MiB for a quarter of the corpus; the whole streamed "
          f"+{(peak - base) / 2**20:.1f} MiB, held +{(held - base) / 2**20:.1f} MiB")
    assert peak - base < 8 * 2**20 < held - base, (base, peak, held)
    ids = np.memmap(tmp_path / "big.bin", np.uint16, mode="r")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    at = 0
    for lo in range(0, len(docs), 10_000):  # the expected ids a slice at a time
        want = np.concatenate([[*e.ids, 1] for e in tok.encode_batch(docs[lo:lo + 10_000])])
        assert np.array_equal(ids[at:at + len(want)], want), lo
        at += len(want)
    assert at == len(ids)
    side = json.loads(data.sidecar_of(tmp_path / "big.bin").read_text())
    assert side["count"] == len(ids) and side["documents"] == len(docs) and side["eos"] == 1
    assert side["inputs"] == [str(tmp_path / "big.parquet")]
    assert tokenize.main([str(tmp_path / "big.jsonl"), "--model", str(model), "-o",
                      str(tmp_path / "jsonl.bin")]) == 0
    from_jsonl = np.fromfile(tmp_path / "jsonl.bin", np.uint16)
    assert np.array_equal(from_jsonl, ids[:len(from_jsonl)]) and from_jsonl[-1] == 1
    assert json.loads(data.sidecar_of(tmp_path / "jsonl.bin").read_text())["documents"] == 3000


@pytest.mark.parametrize(("args", "words"), [
    (["{corpus}", "--model", "{tmp}/nomodel", "-o", "{tmp}/t.bin"], "no tokenizer.json"),
    (["{tmp}/nothere.txt", "--model", "{model}", "-o", "{tmp}/t.bin"], "no such file"),
    (["{corpus}", "--model", "{model}", "-o", "{tmp}/exists.bin"], "exists"),
    (["{corpus}", "--model", "{model}", "-o", "{tmp}/stray.bin"], "exists"),  # its .starts
    (["{corpus}", "--model", "{model}", "-o", "{tmp}/nodir/t.bin"], "does not exist"),
    (["{tmp}/bad.txt", "--model", "{model}", "-o", "{tmp}/t.bin"], "not UTF-8"),
    (["{corpus}", "--model", "{model}", "-o", "{tmp}/t.bin", "--glob", "*.rst"], "no file"),
    (["{corpus}", "--model", "{model}", "-o", "{tmp}/t.bin", "--seed", "x"], "invalid int"),
    (["{corpus}", "--model", "{model}"], "required: -o"),
])
def test_tokenize_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, args,
                                                                 words):
    write_gguf(FIXTURES / "tied_sharded", tmp_path / "m.gguf")
    model = from_gguf.convert(tmp_path / "m.gguf", tmp_path / "m")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the and")
    (tmp_path / "exists.bin").write_bytes(b"")
    (tmp_path / "stray.bin.starts").write_bytes(b"")  # a document-starts file left alone
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
    before = sorted(tmp_path.rglob("*"))
    argv = [a.format(tmp=tmp_path, model=model, corpus=tmp_path / "corpus") for a in args]
    try:
        code = tokenize.main(argv)
    except SystemExit as e:  # argparse's refusals (our Parser: one line, exit 2)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert sorted(tmp_path.rglob("*")) == before


def test_the_subcommands_run_from_the_console_script(tmp_path, env):
    from conftest import pdecomp

    for sub in ("convert", "tokenize"):
        proc = pdecomp([sub, "--help"], tmp_path, env)
        assert proc.returncode == 0 and f"pdecomp {sub}" in proc.stdout
    proc = pdecomp(["convert", str(tmp_path / "none.gguf"), str(tmp_path / "o")], tmp_path, env)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "none.gguf: no such file" in proc.stderr and not (tmp_path / "o").exists()
    assert "pdecomp convert" in pdecomp(["--help"], tmp_path, env).stdout


@pytest.mark.parametrize(("factor", "low", "high", "original", "head_dim", "theta"), [
    (8.0, 1.0, 4.0, 8192, 128, 500000.0),  # Llama 3.1
    (32.0, 1.0, 4.0, 8192, 64, 500000.0),  # Llama 3.2
    (8.0, 1.0, 4.0, 256, 8, 500000.0),  # the fixture: one smoothed frequency
    (4.0, 2.0, 6.0, 4096, 128, 10000.0),  # other bands, several smoothed frequencies
    (8.0, 1.0, 4.0, 64, 4, 500000.0),  # no smoothed frequency
])
def test_llama3_scaling_is_recovered_from_llama_cpps_divisors(factor, low, high, original,
                                                              head_dim, theta, tmp_path):
    """Whatever parameters made the divisors, those found give the same divisors."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    p = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
         "high_freq_factor": high, "original_max_position_embeddings": original}
    divisors = from_gguf.llama3_divisors(inv_freq, p)
    found = [c for c in from_gguf._llama3_candidates(divisors, inv_freq, 8192)
             if np.allclose(from_gguf.llama3_divisors(inv_freq, c), divisors, rtol=1e-4)]
    assert found and found[0]["factor"] == factor


def test_tokenize_refuses_ids_its_dtype_cannot_hold_and_leaves_nothing(tmp_path):
    """A tokenizer whose added ids lie beyond config.json's vocab_size (uint16 chosen for
    it): the id is refused, not wrapped, and no partial file stays behind."""
    batches = [([3], np.array([5, 6, 1])), ([2], np.array([70_000, 1]))]
    with pytest.raises(text.TokenizeError, match=r"ids in \[1, 70000\] do not fit uint16"):
        text.write(tmp_path / "t.bin", batches, vocab=1_000, record={})
    assert list(tmp_path.iterdir()) == []

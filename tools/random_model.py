"""Write a servable model directory with random weights: ``python tools/random_model.py OUT [--shape S]``.

``OUT`` gets what ``pagedflash serve OUT`` (or any Hugging Face loader) reads: ``config.json`` and
``model.safetensors`` (transformers' own init, as ``bench serve`` writes them: bf16 on a GPU, fp32
on the CPU), a ``tokenizer.json`` in which every id of the vocabulary decodes to a word of its own
(``w<id>``; the model's BOS and EOS ids are its special tokens), and a ``tokenizer_config.json``
with a plain chat template. Random weights generate random ids from the whole vocabulary, so a
tokenizer that covered only part of it would stream empty deltas: this one gives every token a
streamed chunk, which is what a load generator timing inter-token latency needs.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from pagedflash.bench.serve import _write_random_model
from pagedflash.engine.config import LLAMA_3_2_1B, LLAMA_3_8B, TINY_LLAMA

SHAPES = {"tiny": TINY_LLAMA, "llama-3.2-1b": LLAMA_3_2_1B, "llama-3-8b": LLAMA_3_8B}
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def word_tokenizer(vocab_size: int, bos: int, eos: int):
    """A ``tokenizers.Tokenizer`` over ``vocab_size`` whitespace-separated words ``w0 .. w<n-1>``
    (``<s>`` and ``</s>`` at the BOS and EOS ids); decoding joins the words with spaces."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    vocab["<s>"], vocab["</s>"] = bos, eos
    del vocab[f"w{bos}"], vocab[f"w{eos}"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the directory to write (created; files in it are replaced)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shape]
    os.makedirs(args.out, exist_ok=True)
    _write_random_model(cfg, args.out, torch.cuda.is_available(), args.seed)
    bos, eos = cfg.get("bos_token_id", 1), cfg["eos_token_id"]
    word_tokenizer(cfg["vocab_size"], bos, eos).save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, f, indent=1)
    print(f"random {args.shape} model in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

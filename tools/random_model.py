"""Write a servable model directory with random weights: ``python tools/random_model.py OUT [--shape S]``.

``OUT`` gets what ``pagedflash serve OUT`` (or any Hugging Face loader) reads: ``config.json`` and
``model.safetensors`` (written by transformers' own class for the shape's architecture, with its
init, as ``bench serve`` writes them: bf16 on a GPU, fp32 on the CPU), a ``tokenizer.json`` in which every id of the vocabulary decodes to a word of its own
(``w<id>``; the model's BOS and EOS ids are its special tokens), and a ``tokenizer_config.json``
with a plain chat template. Random weights generate random ids from the whole vocabulary, so a
tokenizer that covered only part of it would stream empty deltas: this one gives every token a
streamed chunk, which is what a load generator timing inter-token latency needs.

Shapes (:data:`pagedflash.bench.shapes.SHAPES`, the table ``bench serve --shape`` reads too):
Llama-3.2-1B, Llama-3-8B, Gemma-2-2B, Qwen3-1.7B, Qwen3-30B-A3B and GPT-OSS-20B (the published
configs) and ``tiny`` (a 2-layer Llama). ``--tiny`` keeps the shape's family and its switches
(windows, softcaps, q/k norms, experts) at ``tiny``'s sizes (a window of 16, 4 experts, BOS/EOS ids
moved into the small vocabulary): a model the CPU runs in seconds. ``--set KEY=VALUE`` (repeatable;
VALUE read as JSON, else a string) overrides a key of the architecture's transformers config, e.g.
``--set num_hidden_layers=4``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from pagedflash.bench.shapes import SHAPES, tiny, write_random_model

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


def with_overrides(cfg: dict, items: list[str]) -> dict:
    """``cfg`` with ``KEY=VALUE`` overrides; each KEY must be a field of the architecture's
    transformers config class."""
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(cfg["model_type"])
    fields = hf_cfg.to_dict()
    out = dict(cfg)
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set: expected KEY=VALUE, got {item!r}")
        if key not in fields or key in ("architectures", "model_type"):
            raise ValueError(f"--set: {key!r} is not a settable field of {type(hf_cfg).__name__}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the directory to write (created; files in it are replaced)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--tiny", action="store_true", help="the shape's family at tiny sizes (CPU tests)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (VALUE as JSON, else a string); repeatable")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = SHAPES[args.shape]
    if args.tiny:
        cfg = tiny(cfg)
    try:
        cfg = with_overrides(cfg, args.set)
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    write_random_model(cfg, args.out, torch.cuda.is_available(), args.seed)
    bos, eos = cfg.get("bos_token_id", 1), cfg["eos_token_id"]
    word_tokenizer(cfg["vocab_size"], bos, eos).save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, f, indent=1)
    print(f"random {args.shape}{' (tiny)' if args.tiny else ''} model in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

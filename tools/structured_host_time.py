"""Host cost of structured outputs per step: the grammar compiler's start (the vocabulary read once),
a schema's compile, and per constrained row per step the mask fill plus the accept of the sampled
token, over a synthetic byte-level vocabulary of ``--vocab`` tokens (Llama 3's size by default).

    python tools/structured_host_time.py [--vocab 128256] [--rows 1,8,64] [--steps 48] [--device cpu|cuda]

Each row decodes greedily from random logits under its JSON-schema mask (``mask_logits``, the
sampler's own call), so the matchers walk real states; a row whose grammar ends starts again. Prints the medians of 3 runs.
``--beside``: instead, how much a Python loop on the main thread is held up while a second thread
starts the compiler and compiles three new schemas (a server's grammar thread beside its engine loop).
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import threading
import time

import torch

from pagedflash.engine.structured import GrammarCompiler, StructuredOutputsParams, fill_bitmask, mask_logits

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def byte_level_tokenizer(vocab_size: int):
    """A BPE tokenizer (no merges) whose vocabulary is the 256 byte-level characters, then random
    pieces of 2-8 of them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rng = random.Random(0)
    common = [chr(c) for c in range(ord("a"), ord("z") + 1)] * 8 + list('{}":,[] 0123456789') * 4 + alphabet
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["</s>"] = len(vocab)
    while len(vocab) < vocab_size:
        piece = "".join(rng.choice(common) for _ in range(rng.randint(2, 8)))
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, vocab["</s>"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--beside", action="store_true", help="time a Python loop beside compiles on another thread")
    args = ap.parse_args()
    tok, eos = byte_level_tokenizer(args.vocab)
    if args.beside:
        return beside(tok, eos, args.vocab)
    t = time.perf_counter()
    compiler = GrammarCompiler(tok, args.vocab, [eos])
    print(f"vocab {args.vocab}: compiler start {1e3 * (time.perf_counter() - t):.0f} ms")
    for name, params in (("schema", StructuredOutputsParams(json=SCHEMA)),
                         ("json_object", StructuredOutputsParams(json_object=True))):
        t = time.perf_counter()
        compiler.compile(params)
        print(f"{name}: first compile {1e3 * (time.perf_counter() - t):.1f} ms")
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    gen = torch.Generator(device=args.device).manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        runs = []
        for _ in range(3):
            grammars = [compiler.grammar(params) for _ in range(rows)]
            logits = torch.randn(args.steps, rows, args.vocab, generator=gen, device=args.device)
            fill = step_time = 0.0
            for step in range(args.steps):
                t = time.perf_counter()
                fill_bitmask(grammars, list(range(rows)), args.vocab)
                fill += time.perf_counter() - t
                t = time.perf_counter()
                tokens = mask_logits(logits[step], grammars).argmax(-1).tolist()
                for g, token in zip(grammars, tokens):
                    g.accept(token)
                    if g.terminated:  # a finished row's place is taken by a new request
                        g.matcher.reset()
                step_time += time.perf_counter() - t
            runs.append((fill / args.steps, step_time / args.steps))
        fill, step_time = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"{rows:3d} rows: mask fill {1e3 * fill:.2f} ms a step ({1e6 * fill / rows:.0f} us a row); "
              f"the sampler's whole share on {args.device} (fill, copy, apply, argmax, accept) {1e3 * step_time:.2f} ms")


def beside(tok, eos: int, vocab: int) -> None:
    """Each job on a thread of its own while the main thread runs a Python loop: the job's time and
    the loop's longest gap between two iterations (the GIL held elsewhere)."""
    def job(name, fn):
        done, took = threading.Event(), []

        def work():
            t = time.perf_counter()
            fn()
            took.append(time.perf_counter() - t)
            done.set()

        thread = threading.Thread(target=work)
        thread.start()
        last, longest, held = time.perf_counter(), 0.0, 0.0
        while not done.is_set():
            sum(range(1000))
            now = time.perf_counter()
            gap, last = now - last, now
            longest, held = max(longest, gap), held + (gap if gap > 1e-3 else 0.0)
        thread.join()
        print(f"{name}: {1e3 * took[0]:.0f} ms on its thread; the loop's longest gap {1e3 * longest:.1f} ms, "
              f"gaps over 1 ms {1e3 * held:.0f} ms in all")

    made = []
    job("compiler start", lambda: made.append(GrammarCompiler(tok, vocab, [eos])))
    for i in range(3):  # a new schema each (no cache hit)
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"], f"f{i}": {"type": "string", "pattern": "[a-z]{3,9}"}}}
        job(f"schema {i}: first compile and check", functools.partial(made[0].check, StructuredOutputsParams(json=schema)))


if __name__ == "__main__":
    main()

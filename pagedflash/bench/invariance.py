"""``pagedflash bench invariance``: a request's greedy output under load against the same request
served alone, with the batch-invariant mode on (issue 32: equal for 100 % of requests) and off (for
contrast; the H200 load run of issue 32 found 14 % equal).

For each mode, one engine serves ``--num-requests`` requests at once under load: a small KV pool
(``--num-blocks``: requests are preempted and recomputed), a small step budget
(``--max-num-batched-tokens``: long prompts are prefilled in chunks, in steps shared with other
requests' decodes), prefix caching on, and a workload of mixed lengths, half of it sharing a few
system prompts (:func:`~pagedflash.bench.loadgen.shared_prefix_requests`, the rest
:func:`~pagedflash.bench.loadgen.random_requests`, shuffled). Then a reference engine with the same
weights and mode serves the same requests one at a time (``--reference alone``: ``max_num_seqs=1``,
no prefix caching, a pool and step budget that take any prompt in one chunk) or all together in a
big pool (``--reference big-pool``: no preemption, no chunking, no prefix hits; faster). Greedy,
``ignore_eos``. Reported per mode: the % of requests whose token ids are equal, with ``--logprobs K``
the % whose logprobs are bit for bit equal too, and what the loaded run went through (preemptions,
requests and prompt tokens served from the prefix cache, prompts longer than a step). Exit status 1
when the mode on leaves any request different.

Model: random weights of a Llama-3.2-1B shape in bf16 on the GPU (``--model DIR``: a checkpoint
instead); ``--quick``: a one-layer tiny Llama in fp32 and a tiny workload, which on the CPU runs under the
Triton interpreter with the attention dot inside
:func:`pagedflash.testing.row_exact_interpreter_dot` (the interpreter's dot goes through the host
BLAS, which rounds an element by its row's place in a block; a GPU's dot does not).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedflash.bench import loadgen
from pagedflash.bench.common import free_memory
from pagedflash.bench.report import Table, print_summary, print_table, write_results
from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine.config import LLAMA_3_2_1B, TINY_LLAMA
from pagedflash.testing import row_exact_interpreter_dot

MODES = ("on", "off")
FULL = dict(num_requests=300, groups=4, system=256, suffix=(16, 256), prompt=(16, 1024), output=(16, 128),
            page_size=16, num_blocks=800, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048)
QUICK = dict(num_requests=8, groups=2, system=8, suffix=(1, 8), prompt=(3, 20), output=(4, 10),
             page_size=4, num_blocks=12, max_num_seqs=6, max_num_batched_tokens=12, max_model_len=128)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedflash bench invariance", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model and workload (CPU ok)")
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="directory for invariance.json")
    p.add_argument("--model", default=None, help="local HF directory instead of random weights")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated batch-invariant modes to run: on, off")
    p.add_argument("--num-requests", type=int, default=None, help="requests of the loaded run (default 300; quick 8)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pages of the loaded engine (small: preemption)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="running requests of the loaded engine at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step of the loaded engine (small: chunked prefill)")
    p.add_argument("--reference", choices=("alone", "big-pool"), default="alone",
                   help="alone: one request at a time; big-pool: all at once without preemption or chunking")
    p.add_argument("--logprobs", type=int, default=None, help="also compare each token's logprobs (K: top K too)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        print(f"bench invariance: --modes: expected a comma-separated subset of {MODES}, got {args.modes!r}",
              file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.quick:
        print("bench invariance: needs a CUDA GPU (use --quick for a CPU run)", file=sys.stderr)
        return 2
    w = dict(QUICK if args.quick else FULL)
    for key in ("num_requests", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, key)
        if value is not None and value < 1:
            print(f"bench invariance: --{key.replace('_', '-')}: expected an int >= 1, got {value}", file=sys.stderr)
            return 2
        w[key] = w[key] if value is None else value
    model = args.model or _random_model(args.quick)
    requests = workload(w, _vocab_size(model), args.seed)
    need = max(r.prompt_len + r.max_tokens for r in requests)
    if need > w["max_model_len"] or -(-need // w["page_size"]) > w["num_blocks"]:
        print(f"bench invariance: the longest request ({need} tokens) does not fit max_model_len "
              f"{w['max_model_len']} or {w['num_blocks']} pages of {w['page_size']}", file=sys.stderr)
        return 2
    where = ("bf16 on " + torch.cuda.get_device_name()) if on_gpu else (
        "fp32 on the CPU (Triton interpreter; the attention dot inside pagedflash.testing.row_exact_interpreter_dot: "
        "the host BLAS rounds a dot by row position, a GPU's dot does not)")
    print(f"bench invariance: {len(requests)} requests, {where}; reference: {args.reference}", flush=True)
    rows = []
    with contextlib.nullcontext() if on_gpu else row_exact_interpreter_dot():
        for mode in modes:
            rows.append(compare(model, requests, w, mode == "on", args))
            print(f"mode {mode}: {rows[-1]['equal_pct']:.1f} % of requests equal", flush=True)
    table = Table("invariance", f"Greedy outputs under load vs {args.reference}: {len(requests)} requests "
                  f"(prompts {min(r.prompt_len for r in requests)}-{max(r.prompt_len for r in requests)}, outputs "
                  f"{w['output'][0]}-{w['output'][1]}), pool {w['num_blocks']} x {w['page_size']} tokens, "
                  f"max_num_seqs {w['max_num_seqs']}, {w['max_num_batched_tokens']} tokens per step",
                  {"mode": "batch-invariant", "equal_pct": "% equal tokens", "logprobs_equal_pct": "% equal logprobs",
                   "first_diff": "median first diff", "preemptions": "preemptions", "hit_requests": "prefix-hit requests",
                   "hit_tokens": "prefix-hit tokens", "chunked": "prompts > a step", "steps": "steps",
                   "seconds": "loaded s", "same_weights": "same weights"},
                  rows, note=f"{where}. equal: the token ids (and with --logprobs, every logprob bit for bit) of a "
                             "request served under load equal those of the reference; first diff: the position of "
                             "the first different token among the requests that differ; target: 100 % with the "
                             "mode on (issue 32)")
    print_table(table)
    summary = {f"equal_pct_{r['mode']}": r["equal_pct"] for r in rows}
    summary |= {f"logprobs_equal_pct_{r['mode']}": r["logprobs_equal_pct"] for r in rows if r["logprobs_equal_pct"] is not None}
    summary["preemptions"] = sum(r["preemptions"] for r in rows)
    summary["prefix_hit_requests"] = sum(r["hit_requests"] for r in rows)
    print_summary(summary)
    path = write_results("invariance", [table], args.out, quick=args.quick, summary=summary)
    print(f"wrote {path}")
    on = next((r for r in rows if r["mode"] == "on"), None)
    return 1 if on is not None and 100 > min(on["equal_pct"], 100 if on["logprobs_equal_pct"] is None
                                              else on["logprobs_equal_pct"]) else 0


def workload(w: dict, vocab_size: int, seed: int) -> list[loadgen.Request]:
    """Half shared-prefix requests (``groups`` system prompts), half random ones, shuffled."""
    tokens = loadgen.TokenSpace(vocab_size)
    n = w["num_requests"]
    shared = loadgen.shared_prefix_requests(n - n // 2, groups=w["groups"], system_len=w["system"],
                                            suffix_len=w["suffix"], output_len=w["output"], tokens=tokens, seed=seed)
    plain = loadgen.random_requests(n // 2, input_len=w["prompt"], output_len=w["output"], tokens=tokens,
                                    seed=seed + 1) if n // 2 else []
    requests = shared + plain
    random.Random(seed).shuffle(requests)
    return requests


def compare(model, requests: list[loadgen.Request], w: dict, invariant: bool, args) -> dict:
    """The loaded run and the reference run of one mode; the row of the table."""
    prompts = [r.prompt for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, logprobs=args.logprobs) for r in requests]
    common = dict(page_size=w["page_size"], max_model_len=w["max_model_len"], seed=args.seed, batch_invariant=invariant)
    loaded = LLM(model, num_blocks=w["num_blocks"], max_num_seqs=w["max_num_seqs"],
                 max_num_batched_tokens=w["max_num_batched_tokens"], enable_prefix_caching=True, **common)
    digest = _weights_digest(loaded)
    t0 = time.perf_counter()
    got = loaded.generate(prompts, params)
    seconds = time.perf_counter() - t0
    stats = loaded.last_stats
    loaded.close()
    free_memory()
    reference = LLM(model, **reference_engine(requests, w, args.reference), enable_prefix_caching=False, **common)
    same_weights = torch.equal(digest, _weights_digest(reference))
    want = reference.generate(prompts, params)
    reference.close()
    free_memory()
    equal = [g.token_ids == r.token_ids for g, r in zip(got, want)]
    diffs = [next((i for i, (a, b) in enumerate(zip(g.token_ids, r.token_ids)) if a != b), len(g.token_ids))
             for g, r, e in zip(got, want, equal) if not e]
    row = dict(mode="on" if invariant else "off", requests=len(requests), equal_pct=100 * sum(equal) / len(equal),
               logprobs_equal_pct=None, first_diff=statistics.median(diffs) if diffs else None,
               differing=[i for i, e in enumerate(equal) if not e][:50], preemptions=stats["preemptions"],
               hit_requests=sum(o.num_cached_tokens > 0 for o in got), hit_tokens=sum(o.num_cached_tokens for o in got),
               chunked=sum(r.prompt_len > w["max_num_batched_tokens"] for r in requests), steps=stats["steps"],
               seconds=seconds, same_weights=same_weights, errors=stats["num_errors"])
    if args.logprobs is not None:
        row["logprobs_equal_pct"] = 100 * sum(e and g.logprobs == r.logprobs
                                              for g, r, e in zip(got, want, equal)) / len(equal)
    return row


def reference_engine(requests: list[loadgen.Request], w: dict, kind: str) -> dict:
    """The reference engine's pool and limits. ``alone``: one request at a time, a pool for the
    longest, its prompt in one step. ``big-pool``: every request at once in a pool for all of them
    (no preemption), the loaded run's step budget or the longest prompt's, whichever is larger."""
    pages = [-(-(r.prompt_len + r.max_tokens) // w["page_size"]) for r in requests]
    budget = max(max(r.prompt_len for r in requests), w["max_num_batched_tokens"])
    if kind == "alone":
        return dict(num_blocks=max(pages) + 1, max_num_seqs=1, max_num_batched_tokens=budget)
    return dict(num_blocks=sum(pages) + 1, max_num_seqs=len(requests), max_num_batched_tokens=budget)


def _random_model(quick: bool) -> dict:
    """The random-weight model's config: a one-layer tiny Llama for ``--quick`` (under the interpreter
    each layer's attention call is most of a step's time), else Llama-3.2-1B's shape."""
    return {**TINY_LLAMA, "num_hidden_layers": 1} if quick else dict(LLAMA_3_2_1B)


def _vocab_size(model) -> int:
    if isinstance(model, dict):
        return model["vocab_size"]
    from pagedflash.engine.config import ModelConfig

    return ModelConfig.from_pretrained(model).vocab_size


def _weights_digest(llm: LLM) -> torch.Tensor:
    """Each parameter's sum in fp64, on the CPU: two engines hold the same weights iff these match
    (up to a collision no seed change produces)."""
    return torch.stack([p.detach().double().sum() for p in llm.model.parameters()]).cpu()


if __name__ == "__main__":
    sys.exit(main())

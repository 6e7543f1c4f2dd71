"""Where a decode step of the engine spends its time (H200): the kernels of one decode-graph replay
(torch.profiler, grouped by kernel name) and the host's share of a full generate step.
    python tools/profile_engine_step.py [context] [--batch B] [--batch-invariant] [--shape NAME] [--max-model-len N]
    # default 1024, 1, mode off, the Llama-3.2-1B shape, the model's length
``--batch B``: B requests of that context decoding together (the graph of the ladder's size for B).
``--shape NAME``: a named config of :mod:`pagedflash.bench.shapes` (e.g. ``qwen3-30b-a3b``,
``gpt-oss-20b``: a mixture of experts' step), seeded random weights.
``--batch-invariant``: the engine in batch-invariant mode (issue 32: which kernels make its step
slower than the mode-off one; run both in one call to compare).
"""
import argparse
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedflash.bench.common import time_ms
from pagedflash.bench.shapes import SHAPES, shape_config
from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine.runner import GRAPH_BATCH_SIZES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("context", type=int, nargs="?", default=1024, help="prompt tokens of each request")
    p.add_argument("--batch", type=int, default=1, help=f"requests decoding together (1-{GRAPH_BATCH_SIZES[-1]})")
    p.add_argument("--batch-invariant", action="store_true", help="the engine in batch-invariant mode")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b", help="the model's shape")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's length cap (default: the model's; tools/moe_h200.sh serves MoE shapes at 4096)")
    args = p.parse_args()
    if not 1 <= args.batch <= GRAPH_BATCH_SIZES[-1]:
        p.error(f"--batch: expected 1 to {GRAPH_BATCH_SIZES[-1]} (the largest decode graph), got {args.batch}")
    ctx, batch, invariant = args.context, args.batch, args.batch_invariant
    rng = random.Random(0)
    llm = LLM(shape_config(args.shape), max_num_seqs=max(64, batch), batch_invariant=invariant,
              max_model_len=args.max_model_len)  # seeded random weights
    print(f"{args.shape}, batch-invariant mode {'on' if invariant else 'off'}, batch {batch}")
    prompts = [[rng.randrange(3, llm.config.vocab_size) for _ in range(ctx)] for _ in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=1))
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True))
    itl = statistics.median(x for o in outs for x in o.itl[16:])
    graph = llm.runner.graphs[min(size for size in llm.runner.graphs if size >= batch)]
    g_ms = time_ms(graph.replay, graph=False, flush=None, reps=50)  # the step streams its weights itself
    print(f"context {ctx}: ITL median {itl * 1e3:.3f} ms, graph replay {g_ms:.3f} ms (back to back)")
    launch, whole = [], []
    for _ in range(20):  # host cost of one replay call, and launch-to-finish of a lone replay
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        launch.append(t1 - t0)
        whole.append(time.perf_counter() - t0)
    print(f"graph.replay() host call {statistics.median(launch) * 1e3:.3f} ms; "
          f"replay + sync from idle {statistics.median(whole) * 1e3:.3f} ms")

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    print("== kernels of 10 decode-graph replays (self CUDA time)")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    print("== one 32-token generate (CPU + CUDA)")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()

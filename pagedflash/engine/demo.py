"""``python -m pagedflash demo``: the serving engine end to end.

On a CPU-only machine a tiny random Llama runs under the Triton interpreter; on a GPU a
Llama-3.2-1B-shaped model (random weights, bf16) with CUDA graphs. The workload is a batch of requests
sharing a system prompt, so the prefix cache has something to do. Prints output tokens/s, time to
first token, inter-token latency and the prefix-cache hit rate. ``PAGEDFLASH_DEMO_MODEL`` may name a
local Hugging Face directory to serve instead of random weights.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from pagedflash.engine.config import LLAMA_3_2_1B, TINY_LLAMA
from pagedflash.engine.llm import LLM
from pagedflash.engine.sampling import SamplingParams

# (requests, system-prompt tokens, suffix tokens lo..hi, output tokens)
CPU_WORKLOAD = (8, 48, (4, 24), 12)
GPU_WORKLOAD = (128, 1024, (32, 256), 256)


def run_demo(model: str | None = None, *, workload: tuple | None = None, seed: int = 0) -> dict:
    """Serve one batch and print the figures; returns the engine's stats for the run."""
    on_gpu = torch.cuda.is_available()
    model = model or os.environ.get("PAGEDFLASH_DEMO_MODEL") or (LLAMA_3_2_1B if on_gpu else TINY_LLAMA)
    num_requests, system_len, (lo, hi), max_tokens = workload or (GPU_WORKLOAD if on_gpu else CPU_WORKLOAD)
    t0 = time.perf_counter()
    llm = LLM(model, seed=seed, **({} if on_gpu else {"num_blocks": 256, "max_num_batched_tokens": 256}))
    vocab = llm.config.vocab_size
    where = f"GPU ({torch.cuda.get_device_name()})" if on_gpu else "CPU (Triton interpreter)"
    name = model if isinstance(model, str) else "random weights"
    print(f"pagedflash demo on {where}: {llm.config.architecture}, {llm.config.num_layers} layers, hidden "
          f"{llm.config.hidden_size}, {llm.config.num_heads}/{llm.config.num_kv_heads} heads ({name}), "
          f"{llm.dtype}, {llm.num_blocks} pages of {llm.page_size}; ready in {time.perf_counter() - t0:.1f}s")

    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()
    system = rand(system_len)
    prompts = [system + rand(int(torch.randint(lo, hi + 1, (1,), generator=g))) for _ in range(num_requests)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if on_gpu:  # compile the kernels for every shape class before timing (different tokens: no cache hits)
        llm.generate([rand(system_len + hi)] + [rand(lo)] * 3, SamplingParams(max_tokens=8, ignore_eos=True))

    outputs = llm.generate(prompts, params, use_tqdm=True)
    stats = llm.last_stats
    ttft = [o.ttft for o in outputs]
    itl = [x for o in outputs for x in o.itl]
    print(f"  {stats['num_requests']} requests, {stats['prompt_tokens']} prompt + {stats['output_tokens']} "
          f"output tokens in {stats['elapsed_s']:.2f}s ({stats['steps']} steps, {stats['preemptions']} preemptions)")
    print(f"  output throughput   {stats['output_tokens_per_s']:10.1f} tokens/s")
    print(f"  time to first token {1e3 * statistics.mean(ttft):10.1f} ms mean, {1e3 * max(ttft):.1f} ms max")
    if itl:
        print(f"  inter-token latency {1e3 * statistics.mean(itl):10.2f} ms mean")
    print(f"  prefix-cache hits   {100 * stats['prefix_cache_hit_rate']:10.1f} % of prompt tokens "
          f"(shared system prompt of {system_len} tokens)")
    print(f"  request 0 generated {outputs[0].token_ids[:12]}{' ...' if len(outputs[0].token_ids) > 12 else ''}")
    return stats

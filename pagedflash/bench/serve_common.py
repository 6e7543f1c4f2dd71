"""What the sections of ``pagedflash bench serve`` (:mod:`pagedflash.bench.serve`,
:mod:`pagedflash.bench.serve_scale`) share: random prompts, an engine's warm-up before timing, closing
an engine, the steady-state token gaps of a run, and the GPU time of one replay of a decode graph.
"""

from __future__ import annotations

import random

import torch

from pagedflash.bench.common import free_memory, time_ms
from pagedflash.engine import LLM, SamplingParams


def _tokens(rng: random.Random, config, n: int) -> list[int]:
    return [rng.randrange(3, config.vocab_size) for _ in range(n)]


def _warm(llm: LLM, config, rng) -> None:
    """Compile the kernels of every shape class before timing (prompts unrelated to the workload)."""
    long = 300 if torch.cuda.is_available() else 12
    llm.generate([_tokens(rng, config, long)] + [_tokens(rng, config, 5) for _ in range(3)],
                 SamplingParams(max_tokens=4, ignore_eos=True))


def _close(llm: LLM) -> None:
    llm.close()
    free_memory()


def _steady_gaps(outs) -> list[float]:
    """Token gaps after the last request got its first token (all requests decoding together)."""
    start = max(o.ttft for o in outs)
    gaps = []
    for o in outs:
        t = o.ttft
        for gap in o.itl:
            if t >= start - 1e-9:
                gaps.append(gap)
            t += gap
    return gaps or [x for o in outs for x in o.itl]


def _graph_ms(llm: LLM, batch: int, reps: int = 20) -> float | None:
    """GPU time of one replay of the decode graph that served ``batch`` rows (its buffers still hold
    the last step, so a replay recomputes it and rewrites the same K/V values). None with several
    GPUs: rank 0's graph alone would wait in its all-reduce for the others."""
    graphs = llm.runner.graphs
    size = next((b for b in sorted(graphs) if b >= batch), None)
    if size is None or not torch.cuda.is_available() or llm.tensor_parallel_size > 1:
        return None
    return time_ms(graphs[size].replay, graph=False, flush=None, reps=reps)  # it streams the weights itself

"""Timing helper for the device tools: ``calls`` calls captured in one CUDA graph, best of 5 replays.

Public API only (no pagedflash import), so tools that time two checkouts in turns can share it.
"""
import torch


def graph_us(fn, calls: int) -> float:
    """Mean µs per call of ``fn(i)`` for i in range(calls), replayed from one graph (warm-up first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(calls, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best

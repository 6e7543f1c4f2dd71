"""``graph_us(fn, calls)`` for tools that time many different calls as one CUDA graph (tune_gemv.py:
``fn(i)`` cycles through weight copies past L2), on the one timing method,
:func:`pagedflash.bench.common.time_ms` (back-to-back replays, no flush: the calls stream their own
bytes)."""
from pagedflash.bench.common import time_ms


def graph_us(fn, calls: int, reps: int = 5) -> float:
    """Mean µs per call of ``fn(i)`` for i in range(calls), captured in one graph and replayed
    ``reps`` times back to back after one untimed replay."""
    return time_ms(lambda: [fn(i) for i in range(calls)], graph=True, flush=None, reps=reps) * 1e3 / calls

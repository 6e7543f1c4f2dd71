"""Shared benchmark plumbing: timing, SDPA baselines, correctness checks, derived figures.
(Tables, result files and plots are in :mod:`pagedflash.bench.report`.)

:func:`time_ms` is the one timing method of the benchmarks, ``bench tune`` and ``tools/``; its
default is the procedure behind every published figure: ``triton.testing.do_bench(replay,
warmup=25, rep=100, return_mode="median")`` of a CUDA-graph replay of the call (:func:`graphed`;
``--eager`` times the call itself), in milliseconds (``warmup``/``rep`` are time budgets in ms, not
iteration counts). do_bench zeroes a 256 MB buffer before *every* timed call, which evicts the whole
60 MB L2 of an H200, so each call reads its inputs from HBM and no buffer rotation is needed even
for small caches. The zeroing also gives the host a head start (the memset takes roughly 50-90 us)
to enqueue ``fn``: host overhead below that is hidden, above it shows up as time. :func:`host_us`
measures the host side of a call: where it exceeds the kernel time, back-to-back calls without CUDA
graphs would be launch-bound. Why graph replays: docs/performance.md, "v3 — the host, and CUDA-graph
timing".

Without a GPU (``--quick`` under the Triton interpreter) the "time" is the wall clock of one call:
it proves the plumbing works and is not a figure.

Every measured case goes through :func:`measure`: run once, check against the fp32 reference with
the tolerance rule of :mod:`pagedflash.testing` (the one the tests use), then time. A wrong result
is reported as ``FAIL`` and not timed, an out-of-memory as ``OOM``, a baseline that refuses the
shape as ``n/a``; nothing in a sweep crashes the sweep.

Bandwidth bounds and "of peak" figures divide by :func:`pagedflash.bench.hbm.hbm_bandwidth` (the
GPU's datasheet HBM bandwidth).
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedflash.testing import capture_graph, check_close

OOM, NA, FAIL, ERROR = "OOM", "n/a", "FAIL", "error"
_OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)

_TIMING = {"warmup": 25, "rep": 100, "graphs": True, "flush": "zero"}
_AS_SET = object()  # time_ms's flush: as set_timing says
FLUSHES = ("zero", "read", None)


@dataclass
class Config:
    """What every bench gets from the command line."""

    out: Path = Path("bench_results")
    quick: bool = False  # tiny shapes: a smoke run (CPU interpreter or GPU), not figures
    batch_invariant: bool = False  # decode/prefill: every grid point also timed in the batch-invariant mode


class Unsupported(Exception):
    """A baseline refuses this shape/dtype (reported as ``n/a``)."""


def has_gpu() -> bool:
    return torch.cuda.is_available()


def device() -> str:
    return "cuda" if has_gpu() else "cpu"


def set_timing(*, warmup_ms: int = 25, rep_ms: int = 100, graphs: bool = True, flush: str = "zero") -> None:
    """The defaults of :func:`time_ms` (the command line's ``--warmup-ms``, ``--rep-ms``, ``--eager``,
    ``--flush``): ``flush`` is ``"zero"`` or ``"read"`` (:func:`time_ms`), for the calls that do not
    choose their own."""
    if flush not in ("zero", "read"):
        raise ValueError(f"flush must be 'zero' or 'read', got {flush!r}")
    _TIMING.update(warmup=warmup_ms, rep=rep_ms, graphs=graphs, flush=flush)


def timing_flush() -> str:
    """The L2 flush :func:`time_ms` uses by default (:func:`set_timing`): ``"zero"`` or ``"read"``."""
    return _TIMING["flush"]


def timing_description() -> str:
    """How :func:`time_ms` times by default, as the result files record it."""
    if not has_gpu():
        return "CPU wall clock under the Triton interpreter (smoke only, not a figure)"
    what = "CUDA-graph replays" if _TIMING["graphs"] else "eager calls"
    if _TIMING["flush"] == "read":
        return (f"median of {what} timed one by one between CUDA events (both sides), each after a 256 MB read "
                "(L2 flushed, left clean); pagedflash value checks (host syncs) off while timing")
    return (f"triton.testing.do_bench(warmup={_TIMING['warmup']}, rep={_TIMING['rep']}, return_mode='median') of "
            f"{what} (both sides); L2 flushed before every call; pagedflash value checks (host syncs) off while timing")


# ---------------------------------------------------------------- timing


def no_host_syncs():
    """pagedflash's value checks read metadata from the device (a host sync per call); a serving
    engine turns them off, and so does the timing (the first, checked call keeps them on)."""
    from pagedflash import validate

    return validate.value_checks(False)


def graphed(fn: Callable[[], object]) -> Callable[[], object] | None:
    """``fn`` captured in a CUDA graph (its replay), or None when it cannot be captured. The graph
    stays alive until the end of the :func:`time_ms` call that made it."""
    try:
        graph, _ = capture_graph(fn)
        _GRAPHS.append(graph)  # keep its memory pool alive while timing
        return graph.replay
    except Exception:  # noqa: BLE001  (a baseline that cannot be captured is timed eagerly)
        torch.cuda.synchronize()
        return None


_GRAPHS: list = []
_READ_FLUSH: list = []


def time_ms(fn: Callable[[], object], *, graph: bool | None = None, flush: str | None = _AS_SET,
            warmup_ms: int | None = None, rep_ms: int | None = None, reps: int = 20,
            value_checks: bool = False) -> float:
    """Milliseconds per call of ``fn()`` on the GPU; the wall clock of one call without one.

    ``graph``: time the replay of ``fn`` captured in a CUDA graph (default: as :func:`set_timing`
    says, i.e. unless ``--eager``); a call that cannot be captured is timed eagerly. ``flush``, what
    happens to the L2 between calls:

    By default as :func:`set_timing` says (``"zero"`` unless ``--flush read``).

    - ``"zero"`` (the benchmarks' figures): ``do_bench(fn, warmup=warmup_ms, rep=rep_ms,
      return_mode="median")``, which zeroes 256 MB before each call, leaving L2 full of dirty lines
      the timed call must write back as it reads; ``warmup_ms``/``rep_ms`` default to
      :func:`set_timing`'s;
    - ``"read"``: a 256 MB read before each call (L2 left clean), 10 untimed calls then ``reps``
      calls timed one by one between CUDA events, median;
    - ``None``: one untimed call, then ``reps`` calls back to back between two CUDA events, mean:
      for work that streams more than L2 holds by itself (a model step, weights cycled past L2).

    pagedflash's device-reading value checks are off while timing unless ``value_checks``."""
    if flush is _AS_SET:
        flush = _TIMING["flush"]
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
    with contextlib.nullcontext() if value_checks else no_host_syncs():
        if not has_gpu():  # under the interpreter a figure means nothing anyway
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        replay = graphed(fn) if (_TIMING["graphs"] if graph is None else graph) else None
        try:
            return _time_on_gpu(replay or fn, flush, _TIMING["warmup"] if warmup_ms is None else warmup_ms,
                                _TIMING["rep"] if rep_ms is None else rep_ms, reps)
        finally:
            _GRAPHS.clear()


def _time_on_gpu(fn: Callable[[], object], flush: str | None, warmup_ms: int, rep_ms: int, reps: int) -> float:
    if flush == "zero":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if flush is None:
        fn()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    if not _READ_FLUSH:
        _READ_FLUSH.extend([torch.ones(64 * 2**20, device="cuda"), torch.empty((), device="cuda")])
    buf, out = _READ_FLUSH
    times = []
    for i in range(10 + reps):
        torch.sum(buf, dim=0, out=out)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 10:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def host_wall_us(fn: Callable[[], object], *, calls: int, rounds: int = 1, warmup: int = 1,
                 clock=time.perf_counter, stat=statistics.median) -> tuple[float, float]:
    """(host, wall) microseconds per call of ``fn()``: ``stat`` over ``rounds`` loops of ``calls``
    calls, ``clock`` read after the loop (host: what enqueuing cost) and after the synchronize that
    follows it (wall). Never waits on the device inside a loop."""
    sync = torch.cuda.synchronize if has_gpu() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    host, wall = [], []
    for _ in range(rounds):
        sync()
        t0 = clock()
        for _ in range(calls):
            fn()
        t1 = clock()
        sync()
        t2 = clock()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return stat(host), stat(wall)


def host_us(fn: Callable[[], object], calls: int = 20) -> float | None:
    """Host microseconds to enqueue one ``fn()`` (GPU only; value checks off). Above the kernel
    time, back-to-back calls are launch-bound unless captured in a CUDA graph."""
    if not has_gpu():
        return None
    with no_host_syncs():
        return host_wall_us(fn, calls=calls)[0]


def free_memory() -> None:
    gc.collect()
    if has_gpu():
        torch.cuda.empty_cache()


@dataclass
class Measured:
    """The outcome of one case: ``ms`` when it ran and passed, else ``status`` says why not."""

    ms: float | None = None
    status: str = "ok"
    err: float | None = None  # max |out - ref| / max|ref| over the checked slices (pagedflash.testing)
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.ms is not None

    def show(self, f: Callable[[float], float]) -> float | str:
        """``f(ms)`` when measured (e.g. TFLOP/s), else the status string."""
        return f(self.ms) if self.ms is not None else self.status


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def measure(fn: Callable[[], object], check: Callable[[object], tuple[float, bool]] | None = None,
            *, label: str = "", flush: str | None = _AS_SET) -> Measured:
    """Run ``fn`` once, check its output (``check(out) -> (max_err, ok)``), then time it
    (:func:`time_ms`, ``flush`` as there)."""
    err = None
    try:
        if check is not None:
            err, ok = check(_first(fn()))
            if not ok:
                print(f"  FAIL {label}: error {err:.3g} x max|ref| is outside the tolerance rule; not timed",
                      file=sys.stderr)
                return Measured(status=FAIL, err=err)
        return Measured(ms=time_ms(fn, flush=flush), err=err)
    except _OOM_ERRORS:
        free_memory()
        return Measured(status=OOM, err=err)
    except Unsupported as e:
        return Measured(status=NA, note=str(e))
    except Exception as e:  # a broken case must not end a sweep; it is reported and counted
        print(f"  ERROR {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        free_memory()
        return Measured(status=ERROR, note=f"{type(e).__name__}: {e}"[:300])


def failures(cases: Iterable[Measured]) -> int:
    """How many of our own cases failed the check or errored (the bench exits 1 if any)."""
    return sum(c.status in (FAIL, ERROR) for c in cases)


# ---------------------------------------------------------------- checks against the reference


def reference_rows(q, k, v, *, causal: bool, rows: int = 128):
    """fp32 reference for the first and the last ``rows`` query rows of one sequence.

    q ``[Sq, Hq, D]``, k/v ``[Sk, Hkv, D]`` with ``Sq <= Sk`` (bottom-right causal alignment).
    Slicing keeps the reference small at 64K keys while covering both masked corners: the top
    rows see keys ``[0, Sk - Sq + rows)``, the bottom rows see all of them.
    Returns ``(top, bottom)``, each ``[rows, Hq, D]`` fp32.
    """
    from pagedflash.reference import attention_ref

    sq, sk = q.shape[0], k.shape[0]
    r = min(rows, sq)
    top_keys = sk - sq + r if causal else sk
    top, _ = attention_ref(q[None, :r], k[None, :top_keys], v[None, :top_keys], causal=causal)
    bottom, _ = attention_ref(q[None, sq - r:], k[None], v[None], causal=causal)
    return top[0], bottom[0]


def rows_checker(refs: dict[int, tuple[torch.Tensor, torch.Tensor]], dtype, seq: Callable):
    """A ``check`` for :func:`measure`: ``seq(out, b)`` is sequence ``b``'s output ``[Sq, Hq, D]``,
    compared with ``refs[b] = (top, bottom)`` from :func:`reference_rows`."""

    def check(out):
        errs, oks = [], []
        for b, (top, bottom) in refs.items():
            r, rows = top.shape[0], seq(out, b)
            for got, want in ((rows[:r], top), (rows[rows.shape[0] - r:], bottom)):
                e, ok = check_close(got, want, dtype)
                errs.append(e)
                oks.append(ok)
        return max(errs), all(oks)

    return check


# ---------------------------------------------------------------- SDPA baselines

SDPA_BACKENDS = ("flash", "cudnn")


def sdpa(backend: str, q, k, v, *, causal: bool) -> tuple[Callable[[], torch.Tensor], str]:
    """A call of ``F.scaled_dot_product_attention`` pinned to one backend ("flash" or "cudnn").

    q ``[B, Hq, Sq, D]``, k/v ``[B, Hkv, Sk, D]``, contiguous (transposed outside the timing).
    For GQA (Hq != Hkv) ``enable_gqa=True`` is tried first; if the backend refuses it, K/V are
    expanded to Hq heads here, once, and the returned mode says so ("gqa-expanded" reads G times
    the bytes: its time is not comparable byte for byte). Returns ``(fn, mode)``; raises
    :class:`Unsupported` when the backend refuses the shape either way.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    F = torch.nn.functional
    group = q.shape[1] // k.shape[1]

    def make(kk, vv, gqa):
        def fn():
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)

        return fn

    attempts = [("mha", lambda: make(k, v, False))] if group == 1 else [
        ("gqa-native", lambda: make(k, v, True)),
        ("gqa-expanded", lambda: make(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False)),
    ]
    last = None
    for mode, build in attempts:
        try:
            fn = build()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn()
            return fn, mode
        except RuntimeError as e:
            if isinstance(e, _OOM_ERRORS):
                raise
            last = e
    raise Unsupported(f"SDPA {backend}: {str(last).splitlines()[0] if last else 'refused'}")


def measure_sdpa(backend: str, q, k, v, *, causal: bool, check=None, label: str = "") -> Measured:
    """:func:`sdpa` then :func:`measure`; the GQA mode lands in ``note``."""
    try:
        fn, mode = sdpa(backend, q, k, v, causal=causal)
    except Unsupported as e:
        return Measured(status=NA, note=str(e))
    except _OOM_ERRORS:
        free_memory()
        return Measured(status=OOM)
    result = measure(fn, check, label=label)
    result.note = result.note or mode
    return result


def bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` -> contiguous ``[B, H, S, D]`` (SDPA's layout)."""
    return x.transpose(1, 2).contiguous()


# ---------------------------------------------------------------- derived figures


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def tbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e12


def ratio(a: Measured, b: Measured) -> float | str:
    """``b.ms / a.ms``: how many times faster ``a`` is than ``b`` (>1: ``a`` faster)."""
    if a.ok and b.ok:
        return b.ms / a.ms
    return NA


INVARIANT_TARGET = 1.15  # issue 32: a kernel's time in the batch-invariant mode over its default time, at most


def invariant_x(off: Measured, on: Measured) -> float | str:
    """``on.ms / off.ms``: the batch-invariant mode's time over the default's for one point (>1: the
    mode costs), or ``n/a`` when either side has no time."""
    return ratio(off, on)


INVARIANT_NOTE = ("invariant: the same call with batch_invariant=True (fixed-size key splits at absolute positions, "
                  "one tile configuration, splits merged in one order; README 'Batch invariance'), checked against "
                  f"the reference like the default; inv x = its time / the default's, same run (target <= "
                  f"{INVARIANT_TARGET}x, issue 32).")


def geomean(values: Iterable[float | str]) -> float | str:
    xs = [x for x in values if isinstance(x, float) and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else NA


# ---------------------------------------------------------------- small helpers shared by benches


def randn(*shape, dtype, seed: int | None = None) -> torch.Tensor:
    """Normal random values on the bench device (caches are never zeros)."""
    if seed is not None:
        torch.manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, device=device())


def human(n: int) -> str:
    """1024 -> "1K", 131072 -> "128K"."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)

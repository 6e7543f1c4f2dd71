"""Device buffers that a kernel launch writes and reads within one call (split-KV partials, Triton's
global scratch for device-side tensor descriptors), reused from call to call: an allocation costs a
few microseconds of host time per tensor, on every call.

A buffer is reused only by launches that run one after another. It is kept per thread, device,
stream, shape and dtype, so two threads, two streams or two shapes never share one, and a launch
on the stream that used it last starts after that use (stream order). While a CUDA graph is being
captured nothing is reused (the graph keeps the addresses it captured, and its replays may run
beside eager calls): a fresh tensor, as without reuse. Off the GPU nothing is reused either
(nothing to gain under the interpreter, and the tests' NaN-poisoned fresh memory stays in force on
every call, unless :data:`CPU` is set), and neither inside :func:`no_reuse`, which the
``torch.ops.pagedflash`` operators run under: ``torch.compile``'s CUDA graphs
(``mode="reduce-overhead"``) warm up and record in a private memory pool, where a buffer kept past
the call is memory the graph does not own. A thread keeps at most :data:`MAX_BUFFERS` sets of buffers,
dropping the oldest first.
"""

from __future__ import annotations

import contextlib
import threading

import torch

MAX_BUFFERS = 16
REUSE = True  # False: a fresh tensor on every call (as before reuse)
CPU = False  # reuse for CPU tensors too (the overhead bench's CPU mode times the GPU's host path)


class _Local(threading.local):
    off = 0  # no_reuse() depth
    buffers: dict | None = None  # key -> tensors, oldest first


_local = _Local()
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton launches on
# torch.cuda.is_current_stream_capturing's body, called directly (reached only for CUDA tensors)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _fresh(specs, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs)


def buffers(specs: tuple[tuple[tuple[int, ...], torch.dtype], ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Uninitialized tensors of ``specs`` (``(shape, dtype)`` pairs) that the caller's kernels fill
    before they read them."""
    local = _local
    kind = device.type
    if kind == "cuda":
        if local.off or not REUSE or _capturing():
            return _fresh(specs, device)
        index = device.index
        if index is None:
            index = torch.cuda.current_device()
        key = (specs, index, _stream(index))
    elif kind == "cpu" and CPU and REUSE and not local.off:
        key = (specs, -1, 0)
    else:
        return _fresh(specs, device)
    kept = local.buffers
    if kept is None:
        kept = local.buffers = {}
    found = kept.get(key)
    if found is None:
        if len(kept) >= MAX_BUFFERS:
            del kept[next(iter(kept))]
        found = kept[key] = _fresh(specs, device)
    return found


def clear() -> None:
    """Drop this thread's buffers (their memory goes back to torch's caching allocator)."""
    _local.buffers = {}


@contextlib.contextmanager
def no_reuse():
    """Fresh buffers for every launch inside the block (this thread)."""
    _local.off += 1
    try:
        yield
    finally:
        _local.off -= 1

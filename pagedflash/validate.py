"""Host-side checks that every public entry point runs before it launches anything.

Each check raises ``ValueError`` (bad value or shape) or ``TypeError`` (bad dtype or type) with a
message that names the argument, what was expected and what came.

Checks split in two kinds:

- *structural* (dtype, device, rank, shape, strides): always on, cost nothing on the device;
- *value* checks that must read int32 metadata from the device (``cu_seqlens`` monotone and
  matching the totals, page ids inside the pool, lengths within the cache): they synchronize with
  the device (a read waits for every kernel queued before it), so they are a debug mode, off by
  default: :func:`set_value_checks` / :func:`value_checks`, or ``PAGEDFLASH_VALUE_CHECKS=1`` in the
  environment. They are skipped during CUDA-graph capture and ``torch.compile`` tracing.

Without them the kernels check the metadata they read: a row whose metadata is invalid (a length
past the cache, a page id outside the pool, ``cu_seqlens`` not increasing, a slot or position out
of range) reads and writes nothing outside the tensors given, gets NaN output (and LSE), and
records the fault in a small per-device buffer (:func:`fault_buffer`); :func:`raise_if_invalid`
reads it (one synchronization, when the caller chooses) and raises the error naming the argument.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import os
import threading

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # K/V cache storage only; q and outputs stay 16/32-bit
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# window sides from this length up are unbounded (exact for sequences of up to 2**30 tokens; it keeps
# position + window inside int32 in the kernels)
MAX_WINDOW = 2**30
MIN_SOFTCAP = 2.0**-126  # fp32's smallest normal number
_FP32_MAX = torch.finfo(torch.float32).max

_value_checks = os.environ.get("PAGEDFLASH_VALUE_CHECKS", "0").strip().lower() in ("1", "true", "yes", "on")


class FlashAttnValueError(ValueError, RuntimeError):
    """A bad value, raised by :mod:`pagedflash.flash_attn_interface`: code written for flash-attn,
    whose checks raise ``RuntimeError``, catches it as well as code that expects ``ValueError``."""


class FlashAttnTypeError(TypeError, RuntimeError):
    """A bad type, raised by :mod:`pagedflash.flash_attn_interface` (a ``RuntimeError`` as well)."""


def set_value_checks(enabled: bool) -> bool:
    """Turn the device-reading metadata checks on or off; returns the previous setting."""
    global _value_checks
    previous, _value_checks = _value_checks, bool(enabled)
    return previous


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Context manager form of :func:`set_value_checks`."""
    previous = set_value_checks(enabled)
    try:
        yield
    finally:
        set_value_checks(previous)


def value_checks_enabled(*tensors: torch.Tensor) -> bool:
    """Whether to run the checks that read device values: on unless turned off, skipped while
    ``torch.compile`` traces (fake tensors hold no values) and during CUDA-graph capture."""
    if not _value_checks or torch.compiler.is_compiling():
        return False
    if any(t.is_cuda for t in tensors if t is not None) and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_int(name: str, value, minimum: int = 1) -> int:
    """A Python int (not a bool) ``>= minimum``; returns it. Shared by the cache manager and engine."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got {t.dim()}-D of shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where q is), got one on {t.device}")


def check_same_dtype(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise TypeError(f"{name}: expected dtype {ref.dtype} (the dtype of {ref_name}), got {t.dtype}")


def check_no_grad(**tensors) -> None:
    """The kernels are forward-only: an input that requires grad, with autograd on, would silently get
    no gradient through attention, so it is refused (inference runs under ``torch.no_grad()`` or
    ``torch.inference_mode()``, where this passes)."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{name}: requires grad, but pagedflash has no backward pass; call it under "
                             f"torch.no_grad() or torch.inference_mode(), or pass {name}.detach()")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        strides = t.stride()
        if strides[-1] != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {strides}")


def check_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, head_axis: int = -2) -> tuple[int, int]:
    """Check D range and GQA divisibility; return ``(Hq, Hkv)``."""
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    d = q_shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: head dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {d}")
    if k_shape[-1] != d or v_shape[-1] != d:
        name, got = ("k", k_shape[-1]) if k_shape[-1] != d else ("v", v_shape[-1])
        raise ValueError(f"{name}: expected head dim {d} (q's), got {got}")
    hq, hkv = q_shape[head_axis], k_shape[head_axis]
    if v_shape[head_axis] != hkv:
        raise ValueError(f"v: expected {hkv} heads (k's), got {v.shape[head_axis]}")
    if hq == 0 or hkv == 0 or hq % hkv != 0:
        raise ValueError(f"heads: Hq must be a multiple of Hkv, both at least 1, got Hq={hq}, Hkv={hkv}")
    return hq, hkv


def check_window(window_size, causal: bool) -> tuple[int, int]:
    """Normalize ``window_size`` to ``(left, right)`` with -1 meaning unbounded; causal sets right=0.

    Each side is an int (a bool or a float is refused), -1 or >= 0. A side of ``MAX_WINDOW`` or more
    reaches past every key of a sequence the kernels take, so it becomes -1: the kernels' int32
    position arithmetic never sees it."""
    if type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is type(window_size[1]) is int:
        left, right = window_size  # the usual call: no conversion needed
    else:
        try:
            sides = tuple(window_size)
        except TypeError:
            sides = None
        if sides is None or len(sides) != 2 or any(isinstance(w, bool) or not _is_int(w) for w in sides):
            raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}") from None
        left, right = (operator.index(w) for w in sides)
    if left < -1 or right < -1:
        raise ValueError(f"window_size: expected entries >= -1 (-1 = unbounded), got {window_size!r}")
    if left >= MAX_WINDOW:
        left = -1
    if right >= MAX_WINDOW:
        right = -1
    if causal:
        right = 0
    return left, right


def _is_int(value) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_softcap(softcap) -> float:
    """``softcap`` as a float: 0 and None turn it off (0.0), and so does a cap past fp32's largest
    value, inf included (the kernel computes in fp32, where such a cap is inf and ``inf * tanh(s /
    inf)`` is the identity's limit); otherwise ``softcap * tanh(score / softcap)`` with
    ``softcap >= MIN_SOFTCAP`` (fp32's smallest normal number, so that ``1 / softcap`` is finite)."""
    if softcap is None:
        return 0.0
    if type(softcap) is not float and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)):
        raise TypeError(f"softcap: expected a float (0 or None disables it), got {type(softcap).__name__} {softcap!r}")
    softcap = float(softcap)
    if softcap > _FP32_MAX:
        return 0.0
    if not (softcap == 0.0 or softcap >= MIN_SOFTCAP):
        raise ValueError(f"softcap: expected 0, None or inf (no cap), or a value >= {MIN_SOFTCAP:.3g}, got {softcap}")
    return softcap


def check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    scale = float(softmax_scale)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"softmax_scale: expected a finite value > 0, got {softmax_scale}")
    return scale


def check_int32_vector(name: str, t, *, length: int | None, device) -> None:
    check_tensor(name, t, ndim=1, device=device)
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name}: expected shape ({length},), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, *, total_name: str) -> None:
    """Monotone, starts at 0, ends at the packed total, no sequence longer than ``max_seqlen``."""
    if not value_checks_enabled(cu):
        return
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {values}")
    if values[-1] != total:
        raise ValueError(f"{name}: expected the last offset to equal {total_name} = {total}, got {values[-1]}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{name}: a sequence has {max(lengths)} tokens, more than max_seqlen {max_seqlen}")


def check_block_table(block_table, *, batch: int, num_blocks: int, page_size: int, seqlens, device) -> None:
    """int32 ``[B, max_blocks]``, enough columns for every length, every used page id in the pool.

    ``seqlens`` is a host list of per-sequence KV lengths, or None when only the structure can be
    checked (value checks off)."""
    check_tensor("block_table", block_table, ndim=2, device=device)
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table: expected dtype torch.int32, got {block_table.dtype}")
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table: expected {batch} rows (one per sequence), got {block_table.shape[0]}")
    if block_table.stride(-1) != 1:
        raise ValueError(f"block_table: the last dimension must be contiguous, got strides {block_table.stride()}")
    if seqlens is None:
        return
    capacity = block_table.shape[1] * page_size
    for b, n in enumerate(seqlens):
        if n > capacity:
            raise ValueError(
                f"block_table: sequence {b} has {n} tokens but the table holds {block_table.shape[1]} pages "
                f"of {page_size} = {capacity} tokens"
            )
    used = [block_table[b, : -(-n // page_size)] for b, n in enumerate(seqlens) if n > 0]
    if used:
        ids = torch.cat(used)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"block_table: page ids must be in [0, {num_blocks}), got ids in [{lo}, {hi}]")


def check_out(out, *, shape, dtype, device, inputs: dict) -> None:
    """A preallocated output: q's shape, dtype and device, last dim contiguous (other strides are
    honoured), no two elements at one address, and no memory shared with an input, which the kernel
    reads while it writes ``out``. The sharing check reads addresses, which tensors traced by
    ``torch.compile`` do not have: it is skipped while compiling."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)} (q's), got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype} (q's), got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out: expected a tensor on {device} (where q is), got one on {out.device}")
    check_last_dim_contiguous(out=out)
    check_no_grad(out=out)
    if _self_overlapping(out):
        raise ValueError(f"out: expected every element at its own address, got strides {out.stride()} for shape "
                         f"{tuple(out.shape)} (an expanded tensor?)")
    check_out_separate(out, inputs)


def check_out_separate(out: torch.Tensor, inputs: dict) -> None:
    """``out`` shares no memory with the tensors among ``inputs`` (name -> value), which the kernel
    reads while it writes ``out``. Reads addresses, which tensors traced by ``torch.compile`` do
    not have: skipped while compiling."""
    if torch.compiler.is_compiling():
        return
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and _shares_memory(out, t):
            raise ValueError(f"out: shares memory with {name}, which the kernel reads while writing out; "
                             f"pass a separate buffer")


def _self_overlapping(t: torch.Tensor) -> bool:
    """True unless each dim's stride clears the span of the smaller-strided dims (a sufficient test,
    written without sorting so that it runs on SymInt strides)."""
    if t.numel() == 0:
        return False
    dims = [(s, n) for s, n in zip(t.stride(), t.shape) if n > 1]
    for i, (stride, _) in enumerate(dims):
        if stride < 1 + sum((n - 1) * s for s, n in dims if s < stride):
            return True
        if any(s == stride for j, (s, _) in enumerate(dims) if j != i):
            return True
    return False


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges spanned by two tensors intersect (conservative for interleaved views)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def extent(t):
        start = t.data_ptr()
        return start, start + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()

    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def check_paged_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache: expected shape {tuple(k_cache.shape)} (k_cache's), got {tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"v_cache: expected strides {k_cache.stride()} (k_cache's), got {v_cache.stride()}")


# ---------------------------------------------------------------- fp8 K/V and attention sinks


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def check_kv_dtypes(q: torch.Tensor, k_name: str, k: torch.Tensor, v_name: str, v: torch.Tensor) -> None:
    """K/V in q's dtype, or both in one fp8 dtype (stored scaled; q and the output keep their dtype)."""
    allowed = (q.dtype, *FP8_DTYPES)
    if k.dtype not in allowed:
        raise TypeError(f"{k_name}: expected dtype {q.dtype} (the dtype of q) or an fp8 dtype "
                        f"{[str(d) for d in FP8_DTYPES]}, got {k.dtype}")
    if v.dtype != k.dtype:
        raise TypeError(f"{v_name}: expected dtype {k.dtype} (the dtype of {k_name}), got {v.dtype}")


def check_kv_scale(name: str, scale, *, cache: torch.Tensor, cache_name: str, device) -> torch.Tensor | None:
    """A K/V (de)scale: None, or fp32 ``[]``/``[1]`` (one for all heads) or ``[Hkv]`` (one per KV head)
    on q's device, only for an fp8 cache; with value checks on, every entry finite and > 0."""
    if scale is None:
        return None
    if not is_fp8(cache.dtype):
        raise ValueError(f"{name}: scales apply to fp8 caches only ({cache_name} is {cache.dtype}), expected None")
    check_tensor(name, scale, dtypes=(torch.float32,), device=device)
    hkv = cache.shape[-2]
    if not (scale.numel() == 1 and scale.dim() <= 1) and tuple(scale.shape) != (hkv,):
        raise ValueError(f"{name}: expected shape [] or [1] (per tensor) or [{hkv}] (per KV head), "
                         f"got {list(scale.shape)}")
    check_no_grad(**{name: scale})
    if value_checks_enabled(scale):
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            raise ValueError(f"{name}: expected finite values > 0, got {scale.tolist()}")
    return scale


def check_sinks(sinks, *, num_heads: int, device) -> torch.Tensor | None:
    """Attention-sink logits: None, or fp32 ``[Hq]`` on q's device; with value checks on, no NaN and
    no +inf (``-inf`` is a head without a sink)."""
    if sinks is None:
        return None
    check_tensor("sinks", sinks, ndim=1, dtypes=(torch.float32,), device=device)
    if sinks.shape[0] != num_heads:
        raise ValueError(f"sinks: expected shape [{num_heads}] (one logit per query head, Hq), got {list(sinks.shape)}")
    check_no_grad(sinks=sinks)
    if value_checks_enabled(sinks) and bool((torch.isnan(sinks) | torch.isposinf(sinks)).any()):
        raise ValueError(f"sinks: expected finite logits (or -inf for none), got {sinks.tolist()}")
    return sinks


# ---------------------------------------------------------------- metadata faults found by kernels

# Fault codes: the index of a fault's entry in the fault buffer. A kernel that finds one stores the
# largest index (sequence, token) at which it did (tl.atomic_max; -1 = none).
(FAULT_CU_SEQLENS_Q, FAULT_CU_SEQLENS_K, FAULT_SEQLENS_K, FAULT_BLOCK_TABLE, FAULT_SLOT_MAPPING, FAULT_POSITIONS,
 FAULT_TOPK_IDS) = range(7)
NUM_FAULTS = 7
_FAULTS = {
    FAULT_CU_SEQLENS_Q: ("cu_seqlens_q", "sequence",
                         "expected non-decreasing offsets from 0 to the number of packed query tokens"),
    FAULT_CU_SEQLENS_K: ("cu_seqlens_k", "sequence",
                         "expected non-decreasing offsets from 0 to the number of packed keys (paged: "
                         "lengths within the block table's pages; batch-invariant split launches: at "
                         "most max_seqlen_k)"),
    FAULT_SEQLENS_K: ("cache_seqlens", "sequence",
                      "expected lengths (seqused_k; with new k/v, cache_seqlens + S_new) in [0, the cache "
                      "capacity: S_max, or block_table columns x page_size]"),
    FAULT_BLOCK_TABLE: ("block_table", "sequence", "page ids must be in [0, num_blocks)"),
    FAULT_SLOT_MAPPING: ("slot_mapping", "token", "slots must be < num_blocks * page_size (negative: not written)"),
    FAULT_POSITIONS: ("positions", "token", "expected values in [0, rows of cos/sin)"),
    FAULT_TOPK_IDS: ("topk_ids", "token", "expected expert ids in [0, E) (E = w13's first dim)"),
}
# what a kernel did with the rows of a fault (a cache write skips them; attention and RoPE make them NaN)
_FAULT_EFFECT = dict.fromkeys(range(NUM_FAULTS), "its output rows are NaN")
_FAULT_EFFECT[FAULT_SLOT_MAPPING] = "its keys and values were not written"
_FAULT_EFFECT[FAULT_SEQLENS_K] = "its output rows are NaN; a cache append wrote none of its tokens"
_FAULT_EFFECT[FAULT_BLOCK_TABLE] = ("its output rows are NaN; a cache write skipped its tokens bound for an "
                                    "invalid page")
_fault_buffers: dict[torch.device, torch.Tensor] = {}
_fault_lock = threading.Lock()


def fault_buffer(device) -> torch.Tensor:
    """The int32 ``[NUM_FAULTS]`` buffer on ``device`` where kernels record invalid metadata (entry
    ``code``: -1, or the largest sequence or token index with that fault). Made at the device's first
    launch and never replaced, so a CUDA graph that captured its address keeps reporting into it."""
    buf = _fault_buffers.get(device)  # a tensor's device: found at once
    if buf is not None:
        return buf
    device = _indexed(device)
    buf = _fault_buffers.get(device)
    if buf is None:
        with _fault_lock:
            buf = _fault_buffers.get(device)
            if buf is None:  # a normal tensor even when first asked for under inference_mode (it is cleared outside)
                with torch.inference_mode(False):
                    buf = torch.full((NUM_FAULTS,), -1, dtype=torch.int32, device=device)
                _fault_buffers[device] = buf
    return buf


def _indexed(device) -> torch.device:
    """``device`` with its index ("cuda" is the current CUDA device), as tensors name theirs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def invalid_metadata(device=None, *, clear: bool = True) -> list[str]:
    """The faults recorded since the last clear on ``device`` (every device with a buffer if None),
    one message each, naming the argument, the rule and the last offending sequence or token. Reads
    the buffers: waits for the kernels queued before it."""
    devices = list(_fault_buffers) if device is None else [_indexed(device)]
    messages = []
    for dev in devices:
        buf = _fault_buffers.get(dev)
        if buf is None:
            continue
        values = buf.tolist()
        if clear and any(v >= 0 for v in values):
            buf.fill_(-1)
        for code, index in enumerate(values):
            if index >= 0:
                name, unit, rule = _FAULTS[code]
                messages.append(f"{name}: {rule}; a kernel on {dev} found {unit} {index} invalid "
                                f"({_FAULT_EFFECT[code]}; pagedflash.validate.value_checks(True) checks on the host "
                                f"before launching and names the values)")
    return messages


def raise_if_invalid(device=None) -> None:
    """Raise ``ValueError`` if a kernel found invalid metadata since the last call (then clear the
    record). One synchronization: call it where a loop may wait (after a step, in a test)."""
    messages = invalid_metadata(device)
    if messages:
        raise ValueError("invalid metadata: " + "; ".join(messages))

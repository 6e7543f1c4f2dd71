"""Writing new keys/values into a KV cache.

One kernel, two ways to name where each token goes:

- by slot (:func:`write_kv_cache`, the serving engine's path): ``slot = page * page_size + offset``
  per token, negative slots skipped (padding);
- by append (:func:`append_kv`, used by ``flash_attn_with_kvcache(k=..., v=...)``): token ``t`` of
  row ``b`` goes to position ``cache_seqlens[b] + t``, through the block table when paged. The
  position is computed on the device, so appending needs no host sync and is graph-safe.

A contiguous cache ``[B, S_max, Hkv, D]`` is addressed as ``B`` pages of ``S_max`` slots.

Any metadata values are safe: a token whose destination is invalid writes nothing and the kernel
records the fault in :func:`pagedflash.validate.fault_buffer` (read by
:func:`pagedflash.validate.raise_if_invalid`): a slot ``>= num_blocks * page_size`` as
``slot_mapping`` at the token's index; a row whose positions ``cache_seqlens[b] + t`` leave
``[0, S_max)`` (paged: ``[0, block_table columns * page_size)``) as ``cache_seqlens`` at row ``b``,
and none of the row's tokens is written; a page id outside ``[0, num_blocks)`` as ``block_table``
at row ``b`` (the tokens bound for that page are not written). The host reads no metadata values
unless the debug mode (:func:`pagedflash.validate.value_checks`) is on.

An fp8 cache (``float8_e4m3fn``, ``float8_e5m2``) stores ``saturate(k / k_scale[head])`` rounded to
nearest, ties to even (:func:`pagedflash.ops._jit.round_to_fp8`): saturated at the format's largest
finite value, never NaN from finite input; NaN is stored as NaN (the format's bits, with its sign,
on every backend: :func:`pagedflash.ops._jit.to_fp8`). Readers multiply by the same value (``k_descale``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import _jit, custom_ops
from pagedflash.ops.utils import cdiv, head_stride, next_pow2

# fault codes (pagedflash.validate) as the kernel's constants
_FAULT_SLOT: tl.constexpr = tl.constexpr(validate.FAULT_SLOT_MAPPING)
_FAULT_SEQLENS: tl.constexpr = tl.constexpr(validate.FAULT_SEQLENS_K)
_FAULT_TABLE: tl.constexpr = tl.constexpr(validate.FAULT_BLOCK_TABLE)


@triton.jit(do_not_specialize=["stride_tb", "new_per_row", "capacity", "num_pages"])  # vary per call: no recompiles
def _write_kv_kernel(
    K, V,  # new tokens: [T, Hkv, D] (slots) or [B, S_new, Hkv, D] (append)
    KCache, VCache,  # [num_pages, page_size, Hkv, D]
    Slots,  # [T] int64 (BY_SLOT)
    CacheSeqlens,  # [B] int32 (append)
    BlockTable,  # [B, max_blocks] int32 (append, PAGED)
    Faults,  # int32 [NUM_FAULTS]: pagedflash.validate.fault_buffer
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_cp, stride_cs, stride_ch,
    stride_tb, new_per_row, num_heads,
    capacity,  # slots a token may go to: num_pages * page_size (slots), S_max or max_blocks * page_size (append)
    num_pages,  # pages of the pool (PAGED append)
    KScale, VScale,  # [Hkv] fp32, or one value with stride 0 (HAS_K_SCALE / HAS_V_SCALE)
    stride_ks, stride_vs,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BY_SLOT: tl.constexpr, PAGED: tl.constexpr,
    QUANTIZE: tl.constexpr, FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr, FP8_MAX: tl.constexpr,
    HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr,
):
    """One token's heads per program. A token whose destination is invalid writes nothing and
    records its fault: a slot at or past ``capacity`` at its token index (a negative slot is padding);
    a row whose positions ``cache_seqlens[b] + [0, new_per_row)`` leave ``[0, capacity)`` (none of
    its tokens written), or a page id outside ``[0, num_pages)``, at its row."""
    i = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    if BY_SLOT:
        slot = tl.load(Slots + i)
        _jit.report_fault(Faults, _FAULT_SLOT, i, slot >= capacity)
        ok = (slot >= 0) & (slot < capacity)
        slot = tl.where(ok, slot, 0)
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        src_row = i.to(tl.int64) * stride_kt
        src_row_v = i.to(tl.int64) * stride_vt
    else:
        b = i // new_per_row
        t = i % new_per_row
        seqlen = tl.load(CacheSeqlens + b).to(tl.int64)  # int64: no wrap past int32
        ok = (seqlen >= 0) & (seqlen + new_per_row <= capacity)  # the whole row fits, or none of it is written
        _jit.report_fault(Faults, _FAULT_SEQLENS, b, ~ok)
        pos = tl.where(ok, seqlen + t, 0)
        if PAGED:
            page = tl.load(BlockTable + b.to(tl.int64) * stride_tb + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            page_ok = (page >= 0) & (page < num_pages)
            _jit.report_fault(Faults, _FAULT_TABLE, b, ok & ~page_ok)
            ok = ok & page_ok
            page = tl.where(ok, page, 0)
        else:
            page = b.to(tl.int64)
        offset = pos % PAGE_SIZE
        src_row = b.to(tl.int64) * stride_kb + t * stride_kt
        src_row_v = b.to(tl.int64) * stride_vb + t * stride_vt
    # an invalid token masks every head (a scalar bool broadcast into a block mask fails in the interpreter)
    mask = (heads[:, None] < tl.where(ok, num_heads, 0)) & (offs_d[None, :] < HEAD_DIM)
    dst = page * stride_cp + offset * stride_cs + heads[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(K + src_row + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + src_row_v + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if QUANTIZE:  # fp8 cache: k / k_scale[head], saturated and rounded to the format
        h_ok = heads < num_heads
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if HAS_K_SCALE:
            k = k / tl.load(KScale + heads * stride_ks, mask=h_ok, other=1.0)[:, None]
        if HAS_V_SCALE:
            v = v / tl.load(VScale + heads * stride_vs, mask=h_ok, other=1.0)[:, None]
        k = _jit.to_fp8(k, FP8_MANT, FP8_EMIN, FP8_MAX, KCache.dtype.element_ty)
        v = _jit.to_fp8(v, FP8_MANT, FP8_EMIN, FP8_MAX, VCache.dtype.element_ty)
    tl.store(KCache + dst, k, mask=mask)
    tl.store(VCache + dst, v, mask=mask)


def fp8_format(dtype: torch.dtype) -> dict:
    """The constants :func:`pagedflash.ops._jit.round_to_fp8` needs for an fp8 ``dtype``: mantissa bits,
    smallest normal exponent and largest finite value (e4m3fn: 3, -6, 448; e5m2: 2, -14, 57344)."""
    info = torch.finfo(dtype)
    return dict(FP8_MANT=round(-math.log2(info.eps)), FP8_EMIN=round(math.log2(info.smallest_normal)),
                FP8_MAX=float(info.max))


def _launch(k, v, k_cache, v_cache, *, tokens, slots=None, cache_seqlens=None, block_table=None, new_per_row=1,
            k_scale=None, v_scale=None):
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    block_h = min(16, next_pow2(hkv))
    ks = (0, *k.stride()[:2]) if k.dim() == 3 else k.stride()[:3]
    vs = (0, *v.stride()[:2]) if v.dim() == 3 else v.stride()[:3]
    if tokens == 0:
        return
    dummy = k_cache
    quantize = validate.is_fp8(k_cache.dtype)
    fmt = fp8_format(k_cache.dtype) if quantize else dict(FP8_MANT=0, FP8_EMIN=0, FP8_MAX=0.0)
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    if slots is not None:
        capacity = num_pages * page_size
    elif block_table is not None:
        capacity = block_table.shape[1] * page_size
    else:
        capacity = page_size  # a contiguous cache: one page of S_max slots per row
    _write_kv_kernel[(tokens, cdiv(hkv, block_h))](
        k, v, k_cache, v_cache,
        slots if slots is not None else dummy,
        cache_seqlens if cache_seqlens is not None else dummy,
        block_table if block_table is not None else dummy,
        validate.fault_buffer(k_cache.device),
        *ks, *vs, *k_cache.stride()[:3],
        block_table.stride(0) if block_table is not None else 0, new_per_row, hkv, capacity, num_pages,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        head_stride(k_scale), head_stride(v_scale),
        PAGE_SIZE=page_size, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_H=block_h,
        BY_SLOT=slots is not None, PAGED=block_table is not None, QUANTIZE=quantize, **fmt,
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None, num_warps=4,
    )


def append_kv(k, v, k_cache, v_cache, cache_seqlens, block_table=None, *, k_scale=None, v_scale=None) -> None:
    """Write k/v ``[B, S_new, Hkv, D]`` at positions ``cache_seqlens[b] + t`` (shapes checked by the
    caller; quantized by ``k_scale``/``v_scale`` into an fp8 cache). A token whose position or page
    is invalid is not written; the fault is recorded (module docstring)."""
    _launch(k, v, k_cache, v_cache, tokens=k.shape[0] * k.shape[1], cache_seqlens=cache_seqlens,
            block_table=block_table, new_per_row=k.shape[1], k_scale=k_scale, v_scale=v_scale)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter new keys/values into a paged cache, in place.

    Args:
        k, v: ``[T, Hkv, D]``, the cache's dtype; fp16/bf16/fp32 for an fp8 cache.
        k_cache, v_cache: ``[num_blocks, page_size, Hkv, D]``, equal shapes and strides; fp16, bf16,
            fp32, or fp8 (``float8_e4m3fn``/``float8_e5m2``), which stores
            ``saturate(k / k_scale[head])`` rounded to nearest.
        slot_mapping: int64 ``[T]``; ``slot = block_id * page_size + offset``; a negative slot skips
            its token (padding); a slot ``>= num_blocks * page_size`` is not written and recorded as
            a fault (:func:`pagedflash.validate.raise_if_invalid` raises for it), or, with
            :func:`pagedflash.validate.value_checks` on, refused on the host before anything is written.
        k_scale, v_scale: fp8 caches only: fp32 ``[]``/``[1]`` (per tensor) or ``[Hkv]`` (per KV head),
            the values attention later takes as ``k_descale``/``v_descale``; None means 1.
    """
    validate.check_tensor("k_cache", k_cache, ndim=4, dtypes=validate.SUPPORTED_DTYPES + validate.FP8_DTYPES)
    device = k_cache.device
    validate.check_tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device)
    validate.check_paged_caches(k_cache, v_cache)
    new_dtypes = validate.SUPPORTED_DTYPES if validate.is_fp8(k_cache.dtype) else (k_cache.dtype,)
    for name, t in (("k", k), ("v", v)):
        validate.check_tensor(name, t, ndim=3, dtypes=new_dtypes, device=device)
        if tuple(t.shape[1:]) != tuple(k_cache.shape[2:]):
            raise ValueError(f"{name}: expected shape [T, {k_cache.shape[2]}, {k_cache.shape[3]}] (the cache's "
                             f"heads and head dim), got {tuple(t.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (k's), got {tuple(v.shape)}")
    validate.check_last_dim_contiguous(k=k, v=v, k_cache=k_cache)
    k_scale = validate.check_kv_scale("k_scale", k_scale, cache=k_cache, cache_name="k_cache", device=device)
    v_scale = validate.check_kv_scale("v_scale", v_scale, cache=v_cache, cache_name="v_cache", device=device)
    validate.check_tensor("slot_mapping", slot_mapping, ndim=1, device=device)
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping: expected dtype torch.int64, got {slot_mapping.dtype}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping: expected shape ({k.shape[0]},) (one slot per token), got {tuple(slot_mapping.shape)}")
    if not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping: expected a contiguous tensor, got strides {slot_mapping.stride()}")
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel() and validate.value_checks_enabled(slot_mapping):
        top = int(slot_mapping.max())
        if top >= capacity:
            raise ValueError(f"slot_mapping: slots must be < num_blocks * page_size = {capacity}, got {top}")
    _write_op(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _launch_write(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    _launch(k, v, k_cache, v_cache, tokens=k.shape[0], slots=slot_mapping, k_scale=k_scale, v_scale=v_scale)


_write_op = custom_ops.implement("write_kv_cache", _launch_write)

"""Decode against a KV cache with split-KV (flash-decoding): ``flash_attn_with_kvcache``.

With one query row per sequence there is no parallelism along the queries, so the KV range is split
over programs and the partial states merged by LSE (:mod:`pagedflash.ops.combine`). The query heads
that share a KV head are packed into one program, so each KV byte is read once per group. The
contiguous cache and the paged cache go through the same kernel; only the address helper differs.
While ``torch.compile`` traces, the call goes through ``torch.ops.pagedflash.flash_attn_with_kvcache``
(:mod:`pagedflash.ops.custom_ops`), which declares the caches and ``out`` as mutated.
"""

from __future__ import annotations

import torch

from pagedflash import batch_invariance, validate
from pagedflash.ops import custom_ops
from pagedflash.ops.attention import attention_forward, kept_forward
from pagedflash.ops.attention_plan import keep_checks, public_plan_key
from pagedflash.ops.cache_write import append_kv
from pagedflash.ops.utils import PlanCache, checked_signature, new_output


def _check_cache_seqlens(cache_seqlens, batch: int, device) -> torch.Tensor | None:
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, torch.Tensor)):
        raise TypeError(f"cache_seqlens: expected an int or an int32 tensor [B], got {type(cache_seqlens).__name__}")
    if isinstance(cache_seqlens, int):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens: expected a length >= 0, got {cache_seqlens}")
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    validate.check_int32_vector("cache_seqlens", cache_seqlens, length=batch, device=device)
    return cache_seqlens


def _launch(q, k_cache, v_cache, k, v, cache_seqlens, block_table, max_seqlen_k, out,
            softmax_scale, window_left, window_right, softcap, num_splits, return_lse, sinks=None, k_descale=None,
            v_descale=None, batch_invariant=False, signature=None):
    """The operator's launcher; ``signature``: the plan key from the public checks (eager calls
    without new keys only: :func:`pagedflash.ops.attention_plan.public_plan_key`)."""
    s_new = 0
    if k is not None and k.numel():  # appended in q's dtype, or quantized by the descales into an fp8 cache
        append_kv(k, v, k_cache, v_cache, cache_seqlens, block_table, k_scale=k_descale, v_scale=v_descale)
        s_new = k.shape[1]
        cache_seqlens = cache_seqlens + s_new  # int32: a sum past 2^31 wraps negative, which the kernel refuses
    if q.numel() == 0:  # a batch of 0: nothing to attend
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32) if return_lse else None
    scale = validate.check_scale(softmax_scale, q.shape[-1])
    if signature is not None and not s_new:  # the plan kept for the public call's checks, if any
        done = kept_forward(signature, q, k_cache, v_cache, out, return_lse, cache_seqlens, block_table, scale,
                            softcap, window_left, window_right, sinks, k_descale, v_descale, batch_invariant)
        if done is not None:
            return done[1]
    return attention_forward(
        q, k_cache, v_cache, batch=q.shape[0], max_seqlen_q=q.shape[1], max_seqlen_k=max_seqlen_k,
        sm_scale=scale, window=(window_left, window_right),
        softcap=softcap, seqused_k=cache_seqlens, block_table=block_table, num_splits=num_splits,
        return_lse=return_lse, out=out, sinks=sinks, k_descale=k_descale, v_descale=v_descale, min_seqused_k=s_new,
        batch_invariant=batch_invariant, signature=None if s_new else signature,
    )[1]


_op = custom_ops.implement("flash_attn_with_kvcache", _launch)


# the outcome of _check by call signature (checked_signature: every property it reads), as keep_checks keeps it
_CHECKED = PlanCache()


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    num_splits: int = 0,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
):
    """Attention of new queries over a KV cache, flash-attn's ``flash_attn_with_kvcache``.

    Args:
        q: ``[B, Sq, Hq, D]``; Sq = 1 is decode, small Sq (speculative verification) attends causally,
            bottom-right aligned.
        k_cache, v_cache: contiguous ``[B, S_max, Hkv, D]``, or with ``block_table`` paged
            ``[num_blocks, page_size, Hkv, D]`` (any page size); q's dtype or fp8
            (``float8_e4m3fn``/``float8_e5m2``, with ``k_descale``/``v_descale``).
        k, v: optional new tokens ``[B, S_new, Hkv, D]`` in q's dtype, written in place at positions
            ``cache_seqlens[b] .. cache_seqlens[b] + S_new - 1`` before attention, which covers them
            (into an fp8 cache as ``saturate(k / k_descale[head])``, rounded to nearest).
        cache_seqlens: int32 ``[B]`` (or an int) valid cached tokens per row before the new ones;
            None means all ``S_max`` (contiguous cache only).
        block_table: int32 ``[B, max_blocks_per_seq]``.
        num_splits: 0 chooses from B·Hkv, the cache capacity and the SM count (no host sync);
            >= 1 forces a split count (use a fixed one for CUDA-graph capture).
        out: optional preallocated ``[B, Sq, Hq, D]`` output (q's dtype and device, last dim
            contiguous, sharing no memory with q or the caches). Written and returned.
        k_descale, v_descale: fp8 caches only: fp32 ``[]``/``[1]`` (per tensor) or ``[Hkv]`` (per KV
            head); the real key is ``stored.float() * k_descale[head]``; None means 1.
        Other arguments as :func:`pagedflash.flash_attn_func` (``sinks`` and ``batch_invariant`` included).

    Returns:
        out ``[B, Sq, Hq, D]``; with ``return_lse`` also lse ``[B, Hq, Sq]`` fp32. A batch of 0 gives
        empty tensors.

    Shapes, dtypes and host ints are checked here; the values of ``cache_seqlens`` and
    ``block_table`` only in the debug mode (:func:`pagedflash.validate.value_checks`). Otherwise the
    kernel checks them: a row whose length (with the new keys) is negative or past the capacity, or
    whose keys use a page id outside ``[0, num_blocks)``, gets NaN output and LSE and is recorded
    for :func:`pagedflash.validate.raise_if_invalid`.
    """
    key = None
    if out is None and type(cache_seqlens) is not int:  # out's checks read addresses; an int makes a tensor
        key = checked_signature((q, k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, sinks),
                                (softmax_scale, causal, window_size, softcap, num_splits))
    checked = None if key is None else _CHECKED.find(key)
    if checked is None:
        seqlens, checked = _check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                                  window_size, softcap, num_splits, out, k_descale, v_descale, sinks)
        checked = keep_checks(None if key is None else _CHECKED, key, checked, checked[1], q.shape[-1])
    else:
        seqlens = cache_seqlens
    max_len, softmax_scale, left, right, softcap, scale, checks = checked
    invariant = batch_invariance.resolve(batch_invariant)
    # the checks' key covers the plan's with a fresh out (_launch drops it where new keys are appended)
    signature = None if key is None else public_plan_key("kvcache", checks, return_lse, invariant)
    if out is None:
        out = new_output(q)
    if signature is not None and k is None and custom_ops.launches_here(q):  # _op's launcher, its kept-plan path
        done = kept_forward(signature, q, k_cache, v_cache, out, return_lse, seqlens, block_table,
                            scale, softcap, left, right, sinks, k_descale, v_descale, invariant)
        if done is not None:
            return done if return_lse else out
    lse = _op(q, k_cache, v_cache, k, v, seqlens, block_table, max_len, out, softmax_scale, left, right, softcap,
              num_splits, return_lse, sinks, k_descale, v_descale, invariant, signature=signature)
    return (out, lse) if return_lse else out


def _check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
           num_splits, out, k_descale, v_descale, sinks):
    """The checks of :func:`flash_attn_with_kvcache`; returns ``cache_seqlens`` as an int32 tensor (or
    None) and the normalized ``(max_len, softmax_scale, left, right, softcap)``."""
    validate.check_tensor("q", q, ndim=4, dtypes=validate.SUPPORTED_DTYPES)
    device = q.device
    validate.check_tensor("k_cache", k_cache, ndim=4, device=device)
    validate.check_tensor("v_cache", v_cache, ndim=4, device=device)
    validate.check_kv_dtypes(q, "k_cache", k_cache, "v_cache", v_cache)
    validate.check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
    validate.check_no_grad(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    validate.check_head_dims(q, k_cache, v_cache)
    validate.check_paged_caches(k_cache, v_cache)
    batch = q.shape[0]
    paged = block_table is not None
    if not paged and k_cache.shape[0] != batch:
        raise ValueError(f"k_cache: expected batch {batch} (q's), got {k_cache.shape[0]}")
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = automatic), got {num_splits!r}")
    if (k is None) != (v is None):
        raise ValueError(f"k, v: pass both new keys and new values or neither, got k={'set' if k is not None else None}, "
                         f"v={'set' if v is not None else None}")
    s_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            validate.check_tensor(name, t, ndim=4, dtypes=(q.dtype,), device=device)
            want = (batch, t.shape[1], k_cache.shape[2], k_cache.shape[3])
            if tuple(t.shape) != want:
                raise ValueError(f"{name}: expected shape [B, S_new, Hkv, D] = {list(want)}, got {list(t.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v: expected shape {tuple(k.shape)} (k's), got {tuple(v.shape)}")
        validate.check_last_dim_contiguous(k=k, v=v)
        s_new = k.shape[1]
    seqlens = _check_cache_seqlens(cache_seqlens, batch, device)
    if paged:
        if seqlens is None:
            raise ValueError("cache_seqlens: required with block_table (a paged cache has no implied length)")
        validate.check_block_table(block_table, batch=batch, num_blocks=k_cache.shape[0],
                                   page_size=k_cache.shape[1], seqlens=None, device=device)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if seqlens is None and s_new:
            raise ValueError("cache_seqlens: required when appending new k/v (where should they go?)")
    max_len = int(cache_seqlens) + s_new if isinstance(cache_seqlens, int) else capacity
    if max_len > capacity:
        raise ValueError(f"cache_seqlens: cache_seqlens + S_new = {max_len} exceeds the cache capacity {capacity}")
    lengths = None
    if seqlens is not None and validate.value_checks_enabled(seqlens):
        lengths = [n + s_new for n in seqlens.tolist()]
        if lengths and min(lengths) < s_new:
            raise ValueError(f"cache_seqlens: expected lengths >= 0, got {seqlens.tolist()}")
        if lengths and max(lengths) > capacity:
            raise ValueError(f"cache_seqlens: cache_seqlens + S_new = {max(lengths)} exceeds the cache "
                             f"capacity {capacity} (S_max or block_table columns x page_size)")
    if paged and lengths is not None:
        validate.check_block_table(block_table, batch=batch, num_blocks=k_cache.shape[0],
                                   page_size=k_cache.shape[1], seqlens=lengths, device=device)
    if softmax_scale is not None:
        softmax_scale = validate.check_scale(softmax_scale, q.shape[-1])
    left, right = validate.check_window(window_size, causal)
    softcap = validate.check_softcap(softcap)
    k_descale = validate.check_kv_scale("k_descale", k_descale, cache=k_cache, cache_name="k_cache", device=device)
    v_descale = validate.check_kv_scale("v_descale", v_descale, cache=v_cache, cache_name="v_cache", device=device)
    sinks = validate.check_sinks(sinks, num_heads=q.shape[-2], device=device)
    if out is not None:
        validate.check_out(out, shape=q.shape, dtype=q.dtype, device=device,
                           inputs=dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens,
                                       block_table=block_table, sinks=sinks, k_descale=k_descale,
                                       v_descale=v_descale))
    return seqlens, (max_len, softmax_scale, left, right, softcap)

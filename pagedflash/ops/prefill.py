"""Fused prefill attention (FlashAttention-2 style): ``flash_attn_func`` and ``flash_attn_varlen_func``.

Both validate on the host, then launch :mod:`pagedflash.ops.attention` (through their
``torch.ops.pagedflash`` operators while ``torch.compile`` traces: :mod:`pagedflash.ops.custom_ops`);
dense calls and varlen calls over packed K/V or a paged cache on Hopper launch the Gluon kernel
instead where it is faster (:mod:`pagedflash.ops.prefill_hopper` decides).
Memory is O(N·D): the scores are never materialized. With ``block_table`` the varlen form reads
keys/values from a paged cache, which makes it chunked prefill over a cached prefix and the mixed
prefill+decode launch of a serving step.
"""

from __future__ import annotations

import torch

from pagedflash import batch_invariance, validate
from pagedflash.ops import custom_ops, prefill_hopper
from pagedflash.ops.attention import attention_forward, kept_forward
from pagedflash.ops.attention_plan import keep_checks, public_plan_key
from pagedflash.ops.utils import PlanCache, checked_signature, new_output


def _check_common(q, k, v, *, q_ndim: int, kv_ndim: int, fp8_kv: bool = False):
    validate.check_tensor("q", q, ndim=q_ndim, dtypes=validate.SUPPORTED_DTYPES)
    validate.check_tensor("k", k, ndim=kv_ndim, device=q.device)
    validate.check_tensor("v", v, ndim=kv_ndim, device=q.device)
    if fp8_kv:  # K/V may also be stored in fp8
        validate.check_kv_dtypes(q, "k", k, "v", v)
    else:
        validate.check_same_dtype("q", q, k=k, v=v)
    validate.check_last_dim_contiguous(q=q, k=k, v=v)
    validate.check_no_grad(q=q, k=k, v=v)
    return validate.check_head_dims(q, k, v)


def _output(out, q: torch.Tensor, **inputs) -> torch.Tensor:
    """The caller's preallocated output after its checks, or a new ``[..., Hq, D]`` tensor like q."""
    if out is None:
        return new_output(q)
    validate.check_out(out, shape=q.shape, dtype=q.dtype, device=q.device, inputs=dict(q=q, **inputs))
    return out


def _launch_dense(q, k, v, out, softmax_scale, window_left, window_right, softcap, return_lse, sinks=None,
                  batch_invariant=False, signature=None, gluon=None):
    """The operator's launcher; ``signature``: the plan key from the public checks (eager calls
    with a fresh out: :func:`pagedflash.ops.attention_plan.public_plan_key`); ``gluon``: whether
    the Gluon kernel takes the call, where the public call has just asked (None: ask here)."""
    if q.numel() == 0:  # a batch of 0 or Sq = 0: nothing to compute
        return q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32) if return_lse else None
    scale = validate.check_scale(softmax_scale, q.shape[-1])
    if gluon is None:
        gluon = prefill_hopper.refusal(q, k, v, window_left, window_right, softcap, sinks, batch_invariant) is None
    if gluon:
        try:
            return prefill_hopper.forward(q, k, v, out, scale, window_right == 0, return_lse,
                                          invariant=batch_invariant)
        except prefill_hopper.Fallback:
            pass  # the kernel does not compile for this signature: the portable one below
    return attention_forward(
        q, k, v, batch=q.shape[0], max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
        sm_scale=scale, window=(window_left, window_right),
        softcap=softcap, return_lse=return_lse, out=out, sinks=sinks, batch_invariant=batch_invariant,
        signature=signature,
    )[1]


def _launch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, out,
                   softmax_scale, window_left, window_right, softcap, num_splits, return_lse, sinks=None,
                   k_descale=None, v_descale=None, batch_invariant=False, signature=None, gluon=None):
    """The operator's launcher; ``signature`` and ``gluon`` as :func:`_launch_dense`'s."""
    if q.numel() == 0:  # no query tokens
        return q.new_empty((q.shape[1], 0), dtype=torch.float32) if return_lse else None
    batch, scale = cu_seqlens_q.shape[0] - 1, validate.check_scale(softmax_scale, q.shape[-1])
    if gluon is None:
        gluon = prefill_hopper.refusal_varlen(q, k, v, batch, max_seqlen_q, max_seqlen_k, block_table, window_left,
                                              window_right, softcap, sinks, batch_invariant) is None
    if gluon:
        try:
            return prefill_hopper.forward(q, k, v, out, scale, window_right == 0, return_lse,
                                          varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                                          block_table=block_table, k_descale=k_descale, v_descale=v_descale,
                                          invariant=batch_invariant)
        except prefill_hopper.Fallback:
            pass  # the kernel does not compile for this signature: the portable one below
    return attention_forward(
        q, k, v, batch=batch, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        sm_scale=scale, window=(window_left, window_right),
        softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table,
        num_splits=num_splits, return_lse=return_lse, out=out, sinks=sinks, k_descale=k_descale,
        v_descale=v_descale, batch_invariant=batch_invariant, signature=signature,
    )[1]


_dense_op = custom_ops.implement("flash_attn_func", _launch_dense)
_varlen_op = custom_ops.implement("flash_attn_varlen_func", _launch_varlen)


# the outcomes of _check_dense and of _check_varlen by call signature (checked_signature: every property they
# read), as keep_checks keeps them
_CHECKED = PlanCache()
_CHECKED_VARLEN = PlanCache()


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
):
    """Attention over a dense batch, flash-attn's ``flash_attn_func``.

    Args:
        q: ``[B, Sq, Hq, D]``; k, v: ``[B, Sk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA without
            repeating K/V). fp16, bf16 or fp32; ``16 <= D <= 256``; last dim contiguous.
        softmax_scale: defaults to ``1/sqrt(D)``.
        causal: bottom-right aligned when ``Sq != Sk``: query i sees key j iff ``j <= i + Sk - Sq``.
        window_size: ``(left, right)`` local attention, -1 = unbounded.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (after scaling).
        return_lse: also return the natural-log LSE.
        out: optional preallocated output (q's shape, dtype and device; last dim contiguous, other
            strides honoured; sharing no memory with q, k, v). Written and returned.
        sinks: attention sinks (gpt-oss), fp32 ``[Hq]``: one logit per query head that joins the
            softmax denominator and carries no value, ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink))``;
            the LSE then includes it. Softcap does not apply to it.
        batch_invariant: each row bit for bit the same whatever the rest of the call (batch, lengths,
            splits; :mod:`pagedflash.batch_invariance`); None: the process-wide default (off).

    Returns:
        out ``[B, Sq, Hq, D]`` in q's dtype; with ``return_lse``, ``(out, lse)``, lse ``[B, Hq, Sq]``
        fp32. A row that sees no key gets 0 and lse ``-inf`` (with sinks: 0 and lse = its sink). A
        batch of 0 gives empty tensors.
    """
    key = checked_signature((q, k, v, sinks), (softmax_scale, causal, window_size, softcap))
    checked = None if key is None else _CHECKED.find(key)
    if checked is None:
        checked = _check_dense(q, k, v, softmax_scale, causal, window_size, softcap, sinks)
        checked = keep_checks(None if key is None else _CHECKED, key, checked, checked[0], q.shape[-1])
    softmax_scale, left, right, softcap, scale, checks = checked
    invariant = batch_invariance.resolve(batch_invariant)
    # the checks' key covers the plan's where out is fresh
    signature = None if key is None or out is not None else public_plan_key("func", checks, return_lse, invariant)
    out = _output(out, q, k=k, v=v, sinks=sinks)
    gluon = None  # whether the Gluon kernel takes the call, where _dense_op's launcher would run here
    if signature is not None and custom_ops.launches_here(q):
        # asked on every call, not kept with the checks: it reads module switches (ENABLED among them) their key
        # does not cover
        gluon = prefill_hopper.refusal(q, k, v, left, right, softcap, sinks, invariant) is None
        if not gluon:  # the launcher's kept-plan path
            done = kept_forward(signature, q, k, v, out, return_lse, None, None, scale, softcap, left, right, sinks,
                                None, None, invariant)
            if done is not None:
                return done if return_lse else out
    lse = _dense_op(q, k, v, out, softmax_scale, left, right, softcap, return_lse, sinks, invariant,
                    signature=signature, gluon=gluon)
    return (out, lse) if return_lse else out


def _check_dense(q, k, v, softmax_scale, causal, window_size, softcap, sinks) -> tuple[float | None, int, int, float]:
    """The checks of :func:`flash_attn_func` but ``out``'s; returns the normalized
    ``(softmax_scale, left, right, softcap)``."""
    _check_common(q, k, v, q_ndim=4, kv_ndim=4)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch {q.shape[0]} (q's), got {k.shape[0]}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (k's), got {tuple(v.shape)}")
    if softmax_scale is not None:
        softmax_scale = validate.check_scale(softmax_scale, q.shape[-1])
    left, right = validate.check_window(window_size, causal)
    softcap = validate.check_softcap(softcap)
    validate.check_sinks(sinks, num_heads=q.shape[-2], device=q.device)
    return softmax_scale, left, right, softcap


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    block_table: torch.Tensor | None = None,
    num_splits: int = 0,
    out: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
):
    """Attention over packed variable-length sequences, flash-attn's ``flash_attn_varlen_func``.

    Args:
        q: ``[total_q, Hq, D]``, sequence b's queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        k, v: ``[total_k, Hkv, D]`` packed like q by ``cu_seqlens_k``; or, with ``block_table``, the
            paged caches ``[num_blocks, page_size, Hkv, D]`` and ``cu_seqlens_k`` gives each
            sequence's total KV length (cached prefix + its new tokens, already written).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]``, contiguous, non-decreasing, starting at 0.
        max_seqlen_q, max_seqlen_k: upper bounds of the lengths (host ints; they pick tile shapes
            and the KV split, never the result; in batch-invariant mode a sequence longer than
            ``max_seqlen_k`` may get NaN rows, below).
        block_table: int32 ``[B, max_blocks_per_seq]`` page ids (paged mode).
        num_splits: KV splits; 0 chooses from the sizes and the GPU, >= 1 forces (graph capture).
        out: optional preallocated ``[total_q, Hq, D]`` output, checked as in :func:`flash_attn_func`.
        k_descale, v_descale: for K/V stored in fp8 (``float8_e4m3fn``/``float8_e5m2``, dense or
            paged): fp32 ``[]``/``[1]`` (per tensor) or ``[Hkv]`` (per KV head); the real key is
            ``stored.float() * k_descale[head]``; None means 1.
        Other arguments as :func:`flash_attn_func` (``sinks`` included); causal is bottom-right
        aligned per sequence.

    Returns:
        out ``[total_q, Hq, D]``; with ``return_lse`` also lse ``[Hq, total_q]`` fp32.

    Shapes, dtypes and host ints are checked here; the values of ``cu_seqlens_q/k`` and
    ``block_table`` only in the debug mode (:func:`pagedflash.validate.value_checks`). Otherwise the
    kernels check them: a sequence whose offsets are out of order, or past ``q``'s or ``k``'s rows or
    its block table's pages, or longer than ``max_seqlen_q`` (batch-invariant split launches: keys past
    ``max_seqlen_k``), or whose keys use a page id outside
    ``[0, num_blocks)``, gets NaN rows and LSE (invalid ``cu_seqlens_q``: every row, in the portable
    kernel, whose grid is laid out from it); each fault is recorded for
    :func:`pagedflash.validate.raise_if_invalid`.
    """
    key = checked_signature((q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, k_descale, v_descale, sinks),
                            (max_seqlen_q, max_seqlen_k, num_splits, softmax_scale, causal, window_size, softcap))
    checked = None if key is None else _CHECKED_VARLEN.find(key)
    if checked is None:
        checked = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                window_size, softcap, block_table, num_splits, k_descale, v_descale, sinks)
        checked = keep_checks(None if key is None else _CHECKED_VARLEN, key, checked, checked[0], q.shape[-1])
    softmax_scale, left, right, softcap, scale, checks = checked
    # the checks' key covers the plan's where out is fresh
    fresh = key is not None and out is None
    out = _output(out, q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, block_table=block_table,
                  sinks=sinks, k_descale=k_descale, v_descale=v_descale)
    invariant = batch_invariance.resolve(batch_invariant)
    signature = public_plan_key("varlen", checks, return_lse, invariant) if fresh else None
    gluon = None  # whether the Gluon kernel takes the call, where _varlen_op's launcher would run here
    if signature is not None and custom_ops.launches_here(q):
        # asked on every call, as flash_attn_func's: the routing reads module switches the checks' key does not cover
        gluon = prefill_hopper.refusal_varlen(
            q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, block_table, left, right, softcap,
            sinks, invariant) is None
        if not gluon:  # the launcher's kept-plan path
            done = kept_forward(signature, q, k, v, out, return_lse, None, block_table, scale, softcap, left, right,
                                sinks, k_descale, v_descale, invariant, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q))
            if done is not None:
                return done if return_lse else out
    lse = _varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, out,
                     softmax_scale, left, right, softcap, num_splits, return_lse, sinks, k_descale, v_descale,
                     invariant, signature=signature, gluon=gluon)
    return (out, lse) if return_lse else out


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
                  softcap, block_table, num_splits, k_descale, v_descale, sinks) -> tuple[float | None, int, int, float]:
    """The checks of :func:`flash_attn_varlen_func` but ``out``'s; returns the normalized
    ``(softmax_scale, left, right, softcap)``."""
    paged = block_table is not None
    _check_common(q, k, v, q_ndim=3, kv_ndim=4 if paged else 3, fp8_kv=True)
    if paged:
        validate.check_paged_caches(k, v)
    elif v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (k's), got {tuple(v.shape)}")
    validate.check_int32_vector("cu_seqlens_q", cu_seqlens_q, length=None, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if batch < 1:
        raise ValueError(f"cu_seqlens_q: expected at least 2 entries ([B + 1]), got {cu_seqlens_q.shape[0]}")
    validate.check_int32_vector("cu_seqlens_k", cu_seqlens_k, length=batch + 1, device=q.device)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, int) or value < 0:
            raise TypeError(f"{name}: expected a non-negative int, got {value!r}")
    if not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0 = automatic), got {num_splits!r}")
    validate.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, total_name="q.shape[0]")
    if paged:
        lengths = None
        if validate.value_checks_enabled(cu_seqlens_k):
            validate.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, int(cu_seqlens_k[-1]), max_seqlen_k,
                                      total_name="its last entry")
            lengths = torch.diff(cu_seqlens_k).tolist()
        validate.check_block_table(block_table, batch=batch, num_blocks=k.shape[0], page_size=k.shape[1],
                                   seqlens=lengths, device=q.device)
    else:
        validate.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, total_name="k.shape[0]")
    if softmax_scale is not None:
        softmax_scale = validate.check_scale(softmax_scale, q.shape[-1])
    left, right = validate.check_window(window_size, causal)
    softcap = validate.check_softcap(softcap)
    validate.check_kv_scale("k_descale", k_descale, cache=k, cache_name="k", device=q.device)
    validate.check_kv_scale("v_descale", v_descale, cache=v, cache_name="v", device=q.device)
    validate.check_sinks(sinks, num_heads=q.shape[-2], device=q.device)
    return softmax_scale, left, right, softcap

"""Merging partial attention states by their log-sum-exp.

- :func:`plan_combine` / :func:`launch_combine`: the second stage of split-KV (flash-decoding):
  ``num_splits`` partial states of every (token, head) folded into the final output, in a fixed
  order (deterministic); planned once per signature, launched every call.
- :func:`merge_attn_states`: the public two-state merge for cascade / shared-prefix attention.

Both use :func:`pagedflash.ops._jit.merge_state`, which treats an lse of ``±inf`` as an empty state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import _jit, custom_ops, fastlaunch
from pagedflash.ops.utils import cdiv, next_pow2

SPLITS_PER_LOAD = 16  # partial outputs loaded at once: [16, D] fp32 stays in registers


@triton.jit(do_not_specialize=["tokens_per_batch", "num_splits"])  # vary per call: no recompiles
def _combine_kernel(
    OutPart,  # [num_splits, tokens, H, D] fp32
    LsePart,  # [num_splits, tokens, H] fp32 (INVARIANT: [num_splits + 1, ...], the last plane the rows' counts)
    Out,  # [B, S, H, D] or [tokens, H, D]
    Lse,  # [B, H, S] or [H, tokens] fp32 (WRITE_LSE)
    stride_ps, stride_pt, stride_ph,
    stride_lps, stride_lpt,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh, stride_lt,
    tokens_per_batch, num_splits,
    ALL_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr, INVARIANT: tl.constexpr, LOADS: tl.constexpr = 1,
):
    """One (token, head) per program. All split LSEs (ALL_S of them) are read at once and the partial
    outputs with them (up to BLOCK_S splits) or in chunks of BLOCK_S splits whose loads do not wait
    on each other (a split-by-split merge would pay the memory latency once per split). The split
    count is a runtime argument: no recompile per count. A NaN partial (a split that found invalid metadata)
    gives a NaN output and LSE: its weight ``exp(NaN - m)`` is NaN whatever the max ``m`` is, and
    reaches ``total``.

    ``INVARIANT`` (batch-invariant mode): the partials merged one by one, left to right, by
    :func:`pagedflash.ops._jit.merge_weights`, as the attention kernel merges a row's splits when
    one program computes them all: the same row, the same bits, whatever the split count. The row's
    count of slots is the LSE partials' last plane (``LsePart[num_splits]``, written by the attention
    kernel): slots past it (a graph sized for the longest row) are never read nor written, and an
    empty split among the row's (lse ``±inf``, partial 0) merges as the identity (weights 1 and 0),
    as in the kernel's own fold. ``LOADS`` > 1: the row's splits loaded ``LOADS`` at a time, each
    group's loads issued together, then folded in order (a split past the count leaves the state
    as it was): the same operations in the same order, so the same bits, for fewer round trips."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse_base = LsePart + tok * stride_lpt + head
    b = tok // tokens_per_batch
    t = tok % tokens_per_batch
    if INVARIANT:
        count = tl.load(lse_base + tl.cast(num_splits, tl.int64) * stride_lps)  # the row's slots, at least 1
        used = tl.minimum(tl.where(count >= 1.0, count, 0.0).to(tl.int32), num_splits)
        out = tl.zeros([BLOCK_D], dtype=tl.float32)
        lse = tl.full([], float("-inf"), dtype=tl.float32)
        o_base = OutPart + tok * stride_pt + head * stride_ph + offs_d
        if LOADS > 1:
            for c in range(0, used, LOADS):
                lses = ()
                outs = ()
                for j in tl.static_range(LOADS):
                    here = c + j < used
                    sj = tl.cast(c + j, tl.int64)  # split offsets in int64: splits x tokens x H x D may pass 2^31
                    lses = lses + (tl.load(lse_base + sj * stride_lps, mask=here, other=float("-inf")),)
                    outs = outs + (tl.load(o_base + sj * stride_ps, mask=offs_d < tl.where(here, HEAD_DIM, 0),
                                           other=0.0),)
                for j in tl.static_range(LOADS):
                    w_a, w_b, lse_j = _jit.merge_weights(lse, lses[j])
                    out_j = tl.fma(out, w_a, outs[j] * w_b)
                    here = c + j < used
                    out = tl.where(here, out_j, out)
                    lse = tl.where(here, lse_j, lse)
        else:
            # split s + 1 is loaded before split s is folded: its memory round trip overlaps the fold
            # (the fold's order and arithmetic, and so its bits, are those of a load-then-fold loop)
            lse_next = tl.load(lse_base, mask=used >= 1, other=float("-inf"))
            o_next = tl.load(o_base, mask=offs_d < tl.where(used >= 1, HEAD_DIM, 0), other=0.0)
            for s in range(0, used):
                lse_s = lse_next
                o_s = o_next
                s1 = tl.cast(s + 1, tl.int64)  # split offsets in int64: splits x tokens x H x D may pass 2^31
                more = s + 1 < used
                lse_next = tl.load(lse_base + s1 * stride_lps, mask=more, other=float("-inf"))
                o_next = tl.load(o_base + s1 * stride_ps, mask=offs_d < tl.where(more, HEAD_DIM, 0), other=0.0)
                w_a, w_b, lse = _jit.merge_weights(lse, lse_s)
                out = tl.fma(out, w_a, o_s * w_b)
        out = tl.where(used >= 1, out, float("nan"))  # no count written: a NaN, never a plausible 0
        lse = tl.where(used >= 1, lse, float("nan"))
        tl.store(Out + b * stride_ob + t * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty),
                 mask=d_ok)
        if WRITE_LSE:
            tl.store(Lse + b * stride_lb + head * stride_lh + t * stride_lt, lse)
        return
    offs_all = tl.arange(0, ALL_S)
    lse_all = tl.load(lse_base + offs_all.to(tl.int64) * stride_lps, mask=offs_all < num_splits, other=float("-inf"))
    lse_all = _jit.empty_if_inf(lse_all)
    m = tl.max(lse_all, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2((lse_all - m_safe) * _jit.LOG2E), 0)
    o_base = OutPart + tok * stride_pt + head * stride_ph
    if ALL_S <= BLOCK_S:  # every partial in one load, issued with the LSEs' (one memory round trip)
        o_all = tl.load(o_base + offs_all.to(tl.int64)[:, None] * stride_ps + offs_d[None, :],
                        mask=(offs_all < num_splits)[:, None] & d_ok[None, :], other=0.0)
        acc = tl.sum(o_all * tl.exp2((lse_all - m_safe) * _jit.LOG2E)[:, None], 0)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for c in range(0, num_splits, BLOCK_S):
            offs_s = (c + tl.arange(0, BLOCK_S)).to(tl.int64)
            s_ok = offs_s < num_splits
            lse_s = _jit.empty_if_inf(tl.load(lse_base + offs_s * stride_lps, mask=s_ok, other=float("-inf")))
            w = tl.exp2((lse_s - m_safe) * _jit.LOG2E)
            o_s = tl.load(o_base + offs_s[:, None] * stride_ps + offs_d[None, :],
                          mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            acc += tl.sum(o_s * w[:, None], 0)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    tl.store(Out + b * stride_ob + t * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), m_safe + tl.log2(tl.where(empty, 1.0, total)) * _jit.LN2)
        tl.store(Lse + b * stride_lb + head * stride_lh + t * stride_lt, lse)


class CombineLaunch:
    """The combine launch of one split-KV signature: grid, integer arguments, constexprs, and its
    fast-launch slot (:mod:`pagedflash.ops.fastlaunch`); only the tensors change between calls."""

    __slots__ = ("grid", "ints", "consts", "slot")


def plan_combine(out_part, lse_part, out, lse, *, tokens_per_batch: int, invariant: bool = False,
                 loads: int = 1) -> CombineLaunch:
    """The launch that folds split partials ``[S, tokens, H, D]`` / ``[S, tokens, H]`` (``invariant``:
    ``[S + 1, tokens, H]``, the last plane each row's count of splits) into ``out`` (and ``lse``), for
    every call with these tensors' shapes, strides, dtypes and alignment.

    ``out`` is ``[B, Sq, H, D]`` with ``tokens_per_batch = Sq`` or ``[tokens, H, D]`` with
    ``tokens_per_batch = tokens``; ``lse`` is ``[B, H, Sq]``, ``[H, tokens]`` or None. ``invariant``:
    the batch-invariant merge order (:func:`_combine_kernel`), its partials ``loads`` at a time (the
    same bits)."""
    num_splits, tokens, heads, d = out_part.shape
    if lse is None:
        stride_l = (0, 0, 0)
    elif lse.dim() == 2:
        stride_l = (0, lse.stride(0), lse.stride(1))
    else:
        stride_l = lse.stride()
    stride_o = (0, out.stride(0), out.stride(1)) if out.dim() == 3 else out.stride()[:3]
    plan = CombineLaunch()
    plan.grid = (tokens, heads, 1)
    plan.ints = (*out_part.stride()[:3], *lse_part.stride()[:2], *stride_o, *stride_l, tokens_per_batch, num_splits)
    all_s = 1 if invariant else next_pow2(num_splits)  # (the mode's merge loads one split at a time)
    plan.consts = dict(ALL_S=all_s, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
                       BLOCK_S=min(SPLITS_PER_LOAD, next_pow2(num_splits)), WRITE_LSE=lse is not None,
                       INVARIANT=invariant, LOADS=loads if invariant else 1)
    plan.slot = fastlaunch.Slot()
    return plan


def launch_combine(plan: CombineLaunch, out_part, lse_part, out, lse) -> None:
    """Run ``plan`` (from :func:`plan_combine` on tensors like these) on these tensors."""
    args = (out_part, lse_part, out, lse, *plan.ints)  # lse None: absent (WRITE_LSE off)
    if not fastlaunch.run(plan.slot, _combine_kernel, plan.grid, args):
        fastlaunch.launch_public(plan.slot, _combine_kernel, plan.grid, args, plan.consts, absent=out, num_warps=4)


@triton.jit(do_not_specialize=["rows"])
def _merge_kernel(
    OutA, LseA, OutB, LseB, Out, Lse,  # out [R, D] views; lse [R]
    stride_a, stride_b, stride_o, stride_la, stride_lb, rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = r < rows
    mask = r_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_a = tl.load(OutA + r[:, None] * stride_a + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    o_b = tl.load(OutB + r[:, None] * stride_b + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    lse_a = tl.load(LseA + r * stride_la, mask=r_ok, other=float("-inf"))
    lse_b = tl.load(LseB + r * stride_lb, mask=r_ok, other=float("-inf"))
    out, lse = _jit.merge_state(o_a, lse_a, o_b, lse_b)
    tl.store(Out + r[:, None] * stride_o + offs_d[None, :], out.to(Out.dtype.element_ty), mask=mask)
    tl.store(Lse + r, lse, mask=r_ok)


def _rows_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """``[..., H, D]`` as ``[R, D]`` without copying, or a clear error."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name}: expected a tensor whose leading dims can be flattened without a copy, "
                         f"got strides {t.stride()} for shape {tuple(t.shape)}") from None


def merge_attn_states(out_a, lse_a, out_b, lse_b):
    """Merge two attention states computed over disjoint key sets (cascade / shared prefix).

    Args:
        out_a, out_b: ``[..., H, D]`` fp16/bf16/fp32, same shape and dtype.
        lse_a, lse_b: ``[..., H]`` fp32 natural-log LSE of each state. ``-inf`` (or ``+inf``) marks an
            empty state: it contributes nothing and never produces NaN.

    Returns:
        ``(out, lse)``: out ``[..., H, D]`` in the inputs' dtype, lse ``[..., H]`` fp32.
    """
    validate.check_tensor("out_a", out_a, dtypes=validate.SUPPORTED_DTYPES)
    device = out_a.device
    validate.check_tensor("out_b", out_b, dtypes=(out_a.dtype,), device=device)
    if out_b.shape != out_a.shape:
        raise ValueError(f"out_b: expected shape {tuple(out_a.shape)} (out_a's), got {tuple(out_b.shape)}")
    if out_a.dim() < 2:
        raise ValueError(f"out_a: expected at least 2 dims [..., H, D], got shape {tuple(out_a.shape)}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        validate.check_tensor(name, lse, dtypes=(torch.float32,), device=device)
        if lse.shape != out_a.shape[:-1]:
            raise ValueError(f"{name}: expected shape {tuple(out_a.shape[:-1])} (out's without D), got {tuple(lse.shape)}")
    validate.check_last_dim_contiguous(out_a=out_a, out_b=out_b)
    validate.check_no_grad(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    _rows_view("out_a", out_a)
    _rows_view("out_b", out_b)
    return _merge_op(out_a, lse_a, out_b, lse_b)


def _launch_merge(out_a, lse_a, out_b, lse_b):
    """The merge of checked inputs into new contiguous ``out`` and ``lse``."""
    a, b = out_a.view(-1, out_a.shape[-1]), out_b.view(-1, out_b.shape[-1])
    la, lb = lse_a.reshape(-1), lse_b.reshape(-1)
    out = torch.empty(out_a.shape, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(out_a.shape[:-1], dtype=torch.float32, device=out_a.device)
    rows, d = a.shape
    block_r = 16
    if rows > 0:
        _merge_kernel[(cdiv(rows, block_r),)](
            a, la, b, lb, out.view(-1, d), lse.view(-1),
            a.stride(0), b.stride(0), d, la.stride(0), lb.stride(0), rows,
            HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_R=block_r, num_warps=4,
        )
    return out, lse


_merge_op = custom_ops.implement("merge_attn_states", _launch_merge)

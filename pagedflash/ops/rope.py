"""Rotary position embedding, in place, rotate-half layout: the first ``num_heads`` heads of each row
(the q heads then the k heads of a fused qkv projection) are rotated by the angles of the row's
position; the rest of the row (v) is left alone. Partial rotary (``rotary_dim < head_dim``, Phi-3's
``partial_rotary_factor``): the first ``rotary_dim`` dims of each head are rotated, pairs
``(i, i + rotary_dim / 2)``, the rest of the head is left alone.

With q/k norm weights (Qwen3, Qwen3-MoE, Gemma 3: RMSNorm over each q and k head before RoPE) the
same launch first norms each rotated head over its ``head_dim`` dims, the first ``num_q_heads`` with
the q weight and the rest with the k weight: one launch where the unfused path takes five (a norm and
a copy each for q and k, then RoPE). Whole heads only (``rotary_dim == head_dim``). Computed in fp32,
rounded once (:func:`pagedflash.reference.rope_ref`); the unfused path rounds the normed q/k to x's
dtype before rotating them, so the two differ in the last bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import _jit, custom_ops
from pagedflash.ops.utils import Launch, PlanCache, cdiv, check_eps, check_operand, next_pow2

HEADS_PER_PROGRAM = 16


_FAULT_POSITIONS: tl.constexpr = tl.constexpr(validate.FAULT_POSITIONS)


@triton.jit
def _rope_kernel(
    X,  # [T, >= num_heads * head_dim], row stride stride_t
    Cos, Sin,  # [max_len, table_width >= 2 * HALF] fp32, contiguous; only the first HALF of a row is read
    Pos,  # [T] int32/int64
    Faults,  # int32 [NUM_FAULTS]: pagedflash.validate.fault_buffer
    QW, KW,  # [head_dim] q and k norm weights (NORM)
    stride_t, num_heads, head_dim, table_width, max_len, num_q_heads, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr,
):
    """Rotates dims ``0 .. 2 * HALF - 1`` of each head (``2 * HALF`` is the rotary dim); a head's
    dims past them are neither read nor written. ``NORM`` (``2 * HALF == head_dim``): each head is
    first scaled by the rsqrt of its mean square (+ eps) and by the q weight (heads below
    ``num_q_heads``) or the k weight. A position outside ``[0, max_len)`` reads no table row: its
    cos/sin are NaN, so are the row's rotated dims, and the fault is recorded at the token's index."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    mask = (heads[:, None] < num_heads) & d_ok[None, :]
    pos = tl.load(Pos + t).to(tl.int64)
    ok = (pos >= 0) & (pos < max_len)
    _jit.report_fault(Faults, _FAULT_POSITIONS, tl.program_id(0), ~ok)
    pos = tl.where(ok, pos, 0)
    row_ok = d < tl.where(ok, HALF, 0)  # (a scalar bool broadcast into a block mask fails in the interpreter)
    c = tl.load(Cos + pos * table_width + d, mask=row_ok, other=float("nan"))[None, :]
    s = tl.load(Sin + pos * table_width + d, mask=row_ok, other=float("nan"))[None, :]
    p = X + t * stride_t + heads[:, None].to(tl.int64) * head_dim + d[None, :]
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # the head's two halves are all of it: its sum of squares needs no other load of x
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        is_q = (heads < num_q_heads)[:, None]
        w1 = tl.where(is_q, tl.load(QW + d, mask=d_ok, other=0.0)[None, :],
                      tl.load(KW + d, mask=d_ok, other=0.0)[None, :])
        w2 = tl.where(is_q, tl.load(QW + HALF + d, mask=d_ok, other=0.0)[None, :],
                      tl.load(KW + HALF + d, mask=d_ok, other=0.0)[None, :])
        x1 = x1 * rstd[:, None] * w1.to(tl.float32)
        x2 = x2 * rstd[:, None] * w2.to(tl.float32)
    tl.store(p, (x1 * c - x2 * s).to(X.dtype.element_ty), mask=mask)
    tl.store(p + HALF, (x2 * c + x1 * s).to(X.dtype.element_ty), mask=mask)


def _check(x, positions, cos, sin, num_heads, head_dim, rotary_dim, q_norm_weight=None, k_norm_weight=None,
           num_q_heads=0) -> None:
    check_operand("x", x, (None, None))
    validate.check_int("num_heads", num_heads)
    validate.check_int("head_dim", head_dim, minimum=2)
    if head_dim % 2:
        raise ValueError(f"head_dim: expected an even number (rotate-half pairs), got {head_dim}")
    validate.check_int("rotary_dim", rotary_dim, minimum=2)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim: expected an even number in [2, head_dim = {head_dim}] (rotate-half pairs "
                         f"within a head), got {rotary_dim}")
    if x.shape[1] < num_heads * head_dim:
        raise ValueError(f"x: expected rows of at least num_heads * head_dim = {num_heads * head_dim} elements, "
                         f"got shape {tuple(x.shape)}")
    check_operand("positions", positions, (x.shape[0],), dtypes=(torch.int32, torch.int64), contiguous=True)
    for name, table in (("cos", cos), ("sin", sin)):
        check_operand(name, table, (None, None), dtypes=(torch.float32,), contiguous=True)
        if table.shape[1] < rotary_dim:
            raise ValueError(f"{name}: expected shape [max_len, >= rotary_dim = {rotary_dim}], "
                             f"got {tuple(table.shape)}")
    for name, other in (("positions", positions), ("cos", cos), ("sin", sin)):
        if other.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} (where x is), got one on {other.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if q_norm_weight is not None or k_norm_weight is not None:
        _check_norm(x, num_heads, head_dim, rotary_dim, q_norm_weight, k_norm_weight, num_q_heads)
    validate.check_no_grad(x=x, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)


def _check_norm(x, num_heads, head_dim, rotary_dim, q_norm_weight, k_norm_weight, num_q_heads) -> None:
    for name, weight, other in (("q_norm_weight", q_norm_weight, "k_norm_weight"),
                                ("k_norm_weight", k_norm_weight, "q_norm_weight")):
        if weight is None:
            raise ValueError(f"{name}: expected a tensor with {other} (the q and k norms come together), got None")
        check_operand(name, weight, (head_dim,), like=("x", x), contiguous=True)
    if rotary_dim != head_dim:
        raise ValueError(f"rotary_dim: q/k norm weights need whole heads rotated (rotary_dim = head_dim = "
                         f"{head_dim}), got {rotary_dim}")
    validate.check_int("num_q_heads", num_q_heads, minimum=0)
    if num_q_heads > num_heads:
        raise ValueError(f"num_q_heads: expected an int in [0, num_heads = {num_heads}] (the q heads, then the k "
                         f"heads), got {num_q_heads}")


def _plan(x, positions, cos, sin, num_heads, head_dim, rotary_dim, q_norm_weight, k_norm_weight,
          num_q_heads) -> tuple[Launch, torch.Tensor]:
    """Check the operands (all the checks read is in the plan's key) and work out the launch; with
    it, the fault buffer of x's device (in the key)."""
    _check(x, positions, cos, sin, num_heads, head_dim, rotary_dim, q_norm_weight, k_norm_weight, num_q_heads)
    t = x.shape[0]
    block_h = min(HEADS_PER_PROGRAM, next_pow2(num_heads))
    launch = Launch(_rope_kernel, (t, cdiv(num_heads, block_h)) if t else None,
                    dict(HALF=rotary_dim // 2, BLOCK_H=block_h, BLOCK_HALF=next_pow2(rotary_dim // 2),
                         NORM=q_norm_weight is not None))
    return launch, validate.fault_buffer(x.device)


_PLANS = PlanCache()


def _launch(x, positions, cos, sin, num_heads, head_dim, rotary_dim, q_norm_weight=None, k_norm_weight=None,
            num_q_heads=0, eps=0.0) -> None:
    key = _PLANS.key(x, positions, cos, sin, q_norm_weight, k_norm_weight,
                     extra=(num_heads, head_dim, rotary_dim, num_q_heads))
    launch, faults = _PLANS.get(key) or _PLANS.add(key, _plan(x, positions, cos, sin, num_heads, head_dim, rotary_dim,
                                                              q_norm_weight, k_norm_weight, num_q_heads))
    qw, kw = (x, x) if q_norm_weight is None else (q_norm_weight, k_norm_weight)  # (not read without the norm)
    launch(x, cos, sin, positions, faults, qw, kw, x.stride(0), num_heads, head_dim, cos.shape[1], cos.shape[0],
           num_q_heads, eps)


_op = custom_ops.implement("rope_", _launch)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int,
          head_dim: int, rotary_dim: int | None = None, q_norm_weight: torch.Tensor | None = None,
          k_norm_weight: torch.Tensor | None = None, num_q_heads: int | None = None,
          eps: float | None = None) -> None:
    """Rotate, in place, heads ``0 .. num_heads - 1`` of every row of ``x [T, >= num_heads * D]``;
    with q/k norm weights, RMSNorm each of them first.

    x: fp16/bf16/fp32, rows may be strided (last dim contiguous). positions: int32/int64 ``[T]``,
    each in ``[0, max_len)``. cos/sin: contiguous fp32 ``[max_len, >= R]`` (rotate-half tables: a
    row's first ``R / 2`` entries are all that is read). ``D = head_dim``, even; ``R = rotary_dim``
    (default ``D``), even, ``2 <= R <= D``: dims ``0 .. R - 1`` of each head are rotated (pairs
    ``(i, i + R / 2)``), dims ``R .. D - 1`` left as they are.

    q_norm_weight, k_norm_weight: both or neither, contiguous ``[D]`` in x's dtype, ``R = D``; with
    them each head becomes ``head * rsqrt(mean(head²) + eps) * w`` before it is rotated, ``w`` the q
    weight for heads ``0 .. num_q_heads - 1`` (``0 <= num_q_heads <= num_heads``) and the k weight for
    the rest; ``eps`` a finite number >= 0. The weight is the factor itself (Gemma's ``1 + w`` passed
    as such, as the engine stores it). Neither num_q_heads nor eps without the weights.

    By default the checks of shapes, dtypes and devices run on a call signature's first call (and at
    trace time under ``torch.compile``), and no value is read on the host: a position outside
    ``[0, max_len)`` reads no table row, makes the row's rotated dims NaN and is recorded as a
    ``positions`` fault (:func:`pagedflash.validate.raise_if_invalid`). With value checks on
    (:func:`pagedflash.validate.value_checks`, the debug mode) every call checks its inputs and reads
    the positions' range from the device, refusing bad ones before anything is written."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if q_norm_weight is None and k_norm_weight is None:
        if num_q_heads is not None or eps is not None:
            raise ValueError(f"num_q_heads, eps: expected None without q_norm_weight and k_norm_weight, got "
                             f"{num_q_heads!r}, {eps!r}")
        num_q_heads, eps = 0, 0.0
    else:
        eps = check_eps(eps)
    if custom_ops.via_operator() or validate.value_checks_enabled():
        _check(x, positions, cos, sin, num_heads, head_dim, rotary_dim, q_norm_weight, k_norm_weight,
               num_q_heads)  # (the range check below reads valid tensors)
        if positions.numel() and validate.value_checks_enabled(positions):
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= cos.shape[0]:
                raise ValueError(f"positions: expected values in [0, {cos.shape[0]}) (rows of cos/sin), "
                                 f"got values in [{lo}, {hi}]")
    _op(x, positions, cos, sin, num_heads, head_dim, rotary_dim, q_norm_weight, k_norm_weight, num_q_heads, eps)

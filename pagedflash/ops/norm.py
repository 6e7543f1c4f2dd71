"""RMSNorm with the residual add in front: ``rms_norm(x + residual) * weight`` and the residual
stream ``x + residual``, one program per row.

Rounding follows transformers' unfused model: the residual sum is rounded to x's dtype before it is
normalized; the norm is computed in fp32 and rounded to x's dtype, then scaled by the weight and
rounded again (:func:`pagedflash.reference.rms_norm_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import custom_ops
from pagedflash.ops.utils import Launch, PlanCache, check_eps, check_operand, next_pow2


@triton.jit
def _rms_norm_kernel(
    X,  # [T, H]
    Res,  # [T, H] residual in (HAS_RES)
    W,  # [H]
    Out,  # [T, H]
    ResOut,  # [T, H] x + residual (HAS_RES)
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(Res + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (y * w).to(Out.dtype.element_ty), mask=mask)


def _check(x, weight, residual) -> None:
    check_operand("x", x, (None, None))
    t, h = x.shape
    if h < 1:
        raise ValueError(f"x: expected at least one column, got shape {tuple(x.shape)}")
    check_operand("weight", weight, (h,), like=("x", x))
    if residual is not None:
        check_operand("residual", residual, (t, h), like=("x", x))
    validate.check_no_grad(x=x, weight=weight, residual=residual)


def _plan(x, weight, residual) -> Launch:
    """Check the operands (all the checks read is in the :meth:`PlanCache.key`) and work out the launch."""
    _check(x, weight, residual)
    t, h = x.shape
    return Launch(_rms_norm_kernel, (t,) if t else None, dict(HAS_RES=residual is not None, BLOCK=next_pow2(h)),
                  num_warps=8 if h >= 2048 else 4)


_PLANS = PlanCache()


def _launch(x, weight, eps, residual):
    key = _PLANS.key(x, weight, residual)
    plan = _PLANS.get(key) or _PLANS.add(key, _plan(x, weight, residual))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        plan(x, x, weight, out, x, x.stride(0), 0, out.stride(0), 0, x.shape[1], eps)
        return out, None
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    plan(x, residual, weight, out, res_out, x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0),
         x.shape[1], eps)
    return out, res_out


_op = custom_ops.implement("rms_norm", _launch)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)``, or ``(rms_norm(x) * weight, x)`` without a
    residual.

    x, residual: ``[T, H]`` fp16/bf16/fp32, rows may be strided (last dim contiguous); weight ``[H]``
    in x's dtype; eps a finite number >= 0. Returns two ``[T, H]`` tensors in x's dtype. The checks
    run on a call signature's first call (:class:`~pagedflash.ops.utils.PlanCache`), and at trace
    time under ``torch.compile``."""
    eps = check_eps(eps)
    if custom_ops.via_operator():
        _check(x, weight, residual)
    out, res_out = _op(x, weight, eps, residual)
    return out, x if residual is None else res_out

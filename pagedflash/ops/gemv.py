"""Single-row linear layers (batch-1 decode) with the decoder's elementwise step fused in front.

At one token per step a projection is a matrix-vector product: its cost is reading the weight once.
Each program owns ``BLOCK_N`` output features (a few per SM, every SM busy; cuBLAS's 64-feature
tiles leave most SMs of an H200 idle on a 2048-wide projection, docs/performance.md) and streams
its rows of the weight through a pipelined loop over the input dimension.

The input row is formed as the loop reads it, not by a separate launch:

- :func:`rms_norm_gemv`: ``linear(rms_norm(x + residual) * norm_weight)``. Every program walks the
  whole input row, so it sums the squares on the way and scales its dot products by the rstd at the
  end; program 0 also stores ``x + residual``, the residual stream.
- :func:`silu_mul_gemv`: ``linear(silu(gate) * up)`` from the gate/up projection's output, and
  :func:`gelu_tanh_mul_gemv` the same with Gemma's tanh GELU.

Rounding: the residual sum and the gated product are rounded to the input dtype as in the unfused
ops (:mod:`pagedflash.ops.norm`, :mod:`pagedflash.ops.activation`); the normalized row is not
rounded (the unfused path rounds it after the rstd and after the norm weight), a difference of the
order of one rounding of the output. fp32 accumulation, one rounding of the output. References:
:func:`pagedflash.reference.gemv_ref` and its two fused forms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import custom_ops
from pagedflash.ops._jit import gated_product
from pagedflash.ops.utils import (
    Launch,
    PlanCache,
    cdiv,
    check_eps,
    check_gate_up_width,
    check_operand,
    next_pow2,
)

PLAIN, RMS_NORM, SILU_MUL, GELU_TANH_MUL = 0, 1, 2, 3  # the prologue that forms the input row
GATED = {SILU_MUL: "silu", GELU_TANH_MUL: "gelu_tanh"}  # the gated prologues' activations


@triton.jit(do_not_specialize=["eps"])
def _gemv_kernel(
    X,  # [k] (PLAIN, RMS_NORM) or [2k] (SILU_MUL, GELU_TANH_MUL): the one input row
    Res,  # [k] residual (HAS_RES)
    NormW,  # [k] RMSNorm weight (RMS_NORM)
    W,  # [n, k] weight, row stride stride_w
    Bias,  # [n] (HAS_BIAS)
    Out,  # [n]
    ResOut,  # [k] x + residual (HAS_RES)
    n, k, stride_w, eps,
    PROLOGUE: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = X.dtype.element_ty
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < n
    w_rows = W + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        if PROLOGUE >= 2:  # act(gate) * up; X = [gate | up], k wide each
            g = tl.load(X + ks, mask=k_ok, other=0.0)
            xk = gated_product(g, tl.load(X + k + ks, mask=k_ok, other=0.0), ACT).to(tl.float32)
        else:
            x = tl.load(X + ks, mask=k_ok, other=0.0)
            if HAS_RES:  # the residual stream: the sum rounded as unfused; program 0 stores it
                x = (x.to(tl.float32) + tl.load(Res + ks, mask=k_ok, other=0.0).to(tl.float32)).to(dtype)
                if pid == 0:
                    tl.store(ResOut + ks, x, mask=k_ok)
            xk = x.to(tl.float32)
            if PROLOGUE == 1:  # every program walks the whole row: its rms comes with the dot product
                sumsq += xk * xk
                xk = xk * tl.load(NormW + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    if PROLOGUE == 1:
        acc *= 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / k + eps)
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=r_ok, other=0.0).to(tl.float32)
    tl.store(Out + rows, acc.to(Out.dtype.element_ty), mask=r_ok)


TILE: tuple[int, int, int, int] | None = None  # forced tile (tests, tools/tune_gemv.py)


def tile(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an ``n x k`` weight (tools/tune_gemv.py, H200):
    8 rows per program while that still leaves 2+ programs per SM, 32 above; 8 KB of weight per
    pipeline stage; a deeper pipeline on long rows."""
    if TILE is not None:
        return TILE
    if n <= 4096:
        return 8, min(512, next_pow2(k)), 4, 4 if k >= 8192 else 3
    return 32, min(256, next_pow2(k)), 4, 3


def _check(x, weight, bias, residual, norm_weight, prologue: int, out) -> None:
    """The operands of every form: ``x`` the ``[1, k]`` row (``[1, 2k]`` gate and up)."""
    name = "gate_up" if prologue in GATED else "x"
    check_operand(name, x, (1, None))
    k = check_gate_up_width(name, x) if prologue in GATED else x.shape[1]
    if prologue == RMS_NORM:
        check_operand("norm_weight", norm_weight, (k,), like=("x", x))
    if residual is not None:
        check_operand("residual", residual, (1, k), like=("x", x))
    check_operand("weight", weight, (None, k), like=(name, x))
    n = weight.shape[0]
    if n < 1 or k < 1:
        raise ValueError(f"weight: expected at least one row and one column, got shape {tuple(weight.shape)}")
    if bias is not None:
        check_operand("bias", bias, (n,), like=(name, x))
    if out is not None:
        check_operand("out", out, (1, n), like=(name, x))
    validate.check_no_grad(x=x, weight=weight, bias=bias, residual=residual, norm_weight=norm_weight)


def _plan(x, weight, bias, residual, norm_weight, prologue: int, out) -> Launch:
    """Check the operands (all the checks read is in the plan's key) and work out the launch."""
    _check(x, weight, bias, residual, norm_weight, prologue, out)
    block_n, block_k, warps, stages = tile(*weight.shape)
    return Launch(_gemv_kernel, (cdiv(weight.shape[0], block_n),),
                  dict(PROLOGUE=prologue, ACT=GATED.get(prologue, ""), HAS_RES=residual is not None,
                       HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages), num_warps=warps)


_PLANS = PlanCache()


def _launch(x, weight, bias, residual, norm_weight, eps: float, prologue: int, out):
    key = _PLANS.key(x, weight, bias, residual, norm_weight, out, extra=(prologue, TILE))
    plan = _PLANS.get(key) or _PLANS.add(key, _plan(x, weight, bias, residual, norm_weight, prologue, out))
    n, k = weight.shape
    res_out = torch.empty((1, k), dtype=x.dtype, device=x.device) if residual is not None else None
    plan(x, x if residual is None else residual, x if norm_weight is None else norm_weight, weight,
         weight if bias is None else bias, out, x if res_out is None else res_out, n, k, weight.stride(0), eps)
    return res_out


_op = custom_ops.implement("gemv", _launch)


def _run(x, weight, bias, residual, norm_weight, eps: float, prologue: int, out):
    """Check on a signature's first call (and when traced), allocate ``out`` if None, launch:
    ``(out, x + residual or None)``."""
    if custom_ops.via_operator():
        _check(x, weight, bias, residual, norm_weight, prologue, out)
    if out is None:
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            _check(x, weight, bias, residual, norm_weight, prologue, out)  # says what is wrong
        out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    elif isinstance(out, torch.Tensor):  # programs write out while others still read the inputs
        validate.check_out_separate(out, dict(x=x, weight=weight, bias=bias, residual=residual,
                                              norm_weight=norm_weight))
    return out, _op(x, weight, bias, residual, norm_weight, eps, prologue, out)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for one row: x ``[1, k]`` fp16/bf16/fp32; weight ``[n, k]`` (rows may be
    strided, last dim contiguous), bias ``[n]`` and ``out [1, n]`` (written, and returned) in x's
    dtype. Returns ``[1, n]``. The checks run on a call signature's first call, and at trace time
    under ``torch.compile``."""
    return _run(x, weight, bias, None, None, 0.0, PLAIN, out)[0]


def rms_norm_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemv(rms_norm(x + residual) * norm_weight, weight, bias), x + residual)`` for one row (without
    a residual: of x, and x itself second). x, residual: ``[1, k]``; norm_weight ``[k]``; eps a finite
    number >= 0; weight, bias and out as in :func:`gemv`."""
    out, res_out = _run(x, weight, bias, residual, norm_weight, check_eps(eps), RMS_NORM, out)
    return out, x if residual is None else res_out


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``gemv(silu(gate) * up, weight, bias)`` for one row ``gate_up [1, 2k]`` (gate first); weight
    ``[n, k]``, bias and out as in :func:`gemv`."""
    return _run(gate_up, weight, bias, None, None, 0.0, SILU_MUL, out)[0]


def gelu_tanh_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``gemv(gelu_tanh(gate) * up, weight, bias)`` for one row ``gate_up [1, 2k]`` (gate first; Gemma's
    GeGLU, the GELU as :func:`pagedflash.ops.activation.gelu_tanh_mul` computes it); weight ``[n, k]``,
    bias and out as in :func:`gemv`."""
    return _run(gate_up, weight, bias, None, None, 0.0, GELU_TANH_MUL, out)[0]

"""Single-row linear layers with the decoder's elementwise steps fused in front (batch-1 decode).

At one token per step a projection is a matrix-vector product: the cost is reading the weight once.
cuBLAS tiles the output 64 features per thread block, so a 2048-wide projection occupies 32 of an
H200's 132 SMs and reads its weight at ~1.4 TB/s (profile of the engine's batch-1 step,
docs/performance.md v9). Here each program owns ``BLOCK_N`` output features (a few per SM, every SM
busy) and streams its rows of the weight through a pipelined loop over the input dimension.

The input is formed in the prologue of every program instead of by a separate launch:

- ``norm_linear``: ``linear(rms_norm(x + residual))``; the program computes the row's rstd from the
  whole (short) input, program 0 also stores ``x + residual`` for the residual stream.
- ``silu_mul_linear``: ``linear(silu(gate) * up)`` from the gate/up projection's output.

Rounding matches the unfused path (:mod:`pagedflash.engine.fused`): sum rounded to the activation
dtype, norm in fp32 rounded then scaled by the weight and rounded; SiLU rounded before the multiply;
fp32 accumulation, one rounding of the output. Rows other than one (prefill chunks, batched decode)
and CPU runs take the unfused path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from pagedflash.engine import fused
from pagedflash.ops.launch import cdiv, next_pow2

PLAIN, RMS_NORM, SILU_MUL = 0, 1, 2
BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 16, 256, 4, 4  # measured: docs/performance.md v9


@triton.jit
def _input_chunk(X, Res, NormW, ks, k_ok, k, rstd, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):
    """The linear layer's input at columns ``ks`` as fp32, after the prologue (rounded as unfused)."""
    dtype = X.dtype.element_ty
    if PROLOGUE == 2:  # silu(gate) * up; X = [gate | up], k wide each
        g = tl.load(X + ks, mask=k_ok, other=0.0).to(tl.float32)
        u = tl.load(X + k + ks, mask=k_ok, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (act * u).to(dtype).to(tl.float32)
    x = tl.load(X + ks, mask=k_ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(Res + ks, mask=k_ok, other=0.0).to(tl.float32)).to(dtype)
    if PROLOGUE == 1:
        y = (x.to(tl.float32) * rstd).to(dtype).to(tl.float32)
        w = tl.load(NormW + ks, mask=k_ok, other=0.0).to(tl.float32)
        return (y * w).to(dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["eps"])
def _gemv_kernel(
    X,  # [k] (PLAIN, RMS_NORM) or [2k] (SILU_MUL): the one input row
    Res,  # [k] residual (HAS_RES)
    NormW,  # [k] RMSNorm weight (RMS_NORM)
    W,  # [n, k] weight, row stride stride_w
    Bias,  # [n] (HAS_BIAS)
    Out,  # [n]
    ResOut,  # [k] x + residual (HAS_RES)
    n, k, stride_w, eps,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_POW2: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    rstd = 1.0
    if PROLOGUE == 1 or HAS_RES:  # the whole input row: its rms, and the residual stream (program 0)
        ka = tl.arange(0, K_POW2)
        ka_ok = ka < k
        xa = tl.load(X + ka, mask=ka_ok, other=0.0)
        if HAS_RES:
            xa = (xa.to(tl.float32) + tl.load(Res + ka, mask=ka_ok, other=0.0).to(tl.float32)).to(xa.dtype)
            if pid == 0:
                tl.store(ResOut + ka, xa, mask=ka_ok)
        xf = xa.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / k + eps)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < n
    w_rows = W + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        xk = _input_chunk(X, Res, NormW, ks, k_ok, k, rstd, PROLOGUE, HAS_RES)
        w = tl.load(w_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(Bias + rows, mask=r_ok, other=0.0).to(tl.float32)
    tl.store(Out + rows, acc.to(Out.dtype.element_ty), mask=r_ok)


def applies(x: torch.Tensor) -> bool:
    """Whether the fused single-row kernels serve ``x [T, ...]``: one row, kernels on (a GPU)."""
    return x.shape[0] == 1 and fused.use_kernels(x)


def _launch(x, linear: nn.Linear, prologue: int, k: int, *, residual=None, norm_w=None, eps=0.0, out=None):
    w = linear.weight
    n = w.shape[0]
    if w.shape[1] != k or w.stride(1) != 1 or not x.is_contiguous():
        raise ValueError(f"gemv: weight {tuple(w.shape)} (strides {w.stride()}) does not take a {k}-wide "
                         f"contiguous input row {tuple(x.shape)}")
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    bias = linear.bias
    _gemv_kernel[(cdiv(n, BLOCK_N),)](
        x, residual if residual is not None else x, norm_w if norm_w is not None else x, w,
        bias if bias is not None else w, out, res_out, n, k, w.stride(0), eps,
        PROLOGUE=prologue, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_N=BLOCK_N, BLOCK_K=min(BLOCK_K, next_pow2(k)), K_POW2=next_pow2(k), NUM_STAGES=NUM_STAGES,
        num_warps=NUM_WARPS,
    )
    return out, res_out


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm, linear: nn.Linear, out=None):
    """``(linear(norm(x + residual)), x + residual)``; ``norm`` is the model's RMSNorm module.
    ``out``: where the (contiguous) result goes; a new tensor when None."""
    if not applies(x):
        h, residual = norm(x, residual)
        if out is None:
            return linear(h), residual
        return out.copy_(linear(h)), residual
    return _launch(x, linear, RMS_NORM, x.shape[1], residual=residual, norm_w=norm.weight, eps=norm.eps, out=out)


def silu_mul_linear(gate_up: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(silu(gate) * up)`` for ``gate_up [T, 2n]`` (gate first)."""
    if not applies(gate_up):
        return linear(fused.silu_mul(gate_up))
    return _launch(gate_up, linear, SILU_MUL, gate_up.shape[1] // 2)[0]


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)``, through the single-row kernel where it applies."""
    return _launch(x, layer, PLAIN, x.shape[1])[0] if applies(x) else layer(x)

"""Single-row linear layers with the decoder's elementwise steps fused in front (batch-1 decode).

At one token per step a projection is a matrix-vector product: the cost is reading the weight once.
cuBLAS tiles the output 64 features per thread block, so a 2048-wide projection occupies 32 of an
H200's 132 SMs and reads its weight at ~1.4 TB/s (profile of the engine's batch-1 step,
docs/performance.md v9). Here each program owns ``BLOCK_N`` output features (a few per SM, every SM
busy) and streams its rows of the weight through a pipelined loop over the input dimension.

The input is formed as the loop reads it instead of by a separate launch:

- ``norm_linear``: ``linear(rms_norm(x + residual))``. Every program walks the whole input row, so
  it sums the squares on the way and scales its dot products by the rstd at the end (no pass over
  the row before the weight streams); program 0 also stores ``x + residual``, the residual stream.
- ``silu_mul_linear``: ``linear(silu(gate) * up)`` from the gate/up projection's output.

Rounding: the residual sum and the SiLU product are rounded to the activation dtype as in the unfused
path (:mod:`pagedflash.engine.fused`); the normalized input is not rounded before the product (the
unfused path rounds it twice, after the rstd and after the weight), a difference of the order of
one bf16 rounding in the output. fp32 accumulation, one rounding of the output. Rows other than one
(prefill chunks, batched decode) and CPU runs take the unfused path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from pagedflash.engine import fused
from pagedflash.ops.launch import cdiv, next_pow2

PLAIN, RMS_NORM, SILU_MUL = 0, 1, 2


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
        if PROLOGUE == 2:  # silu(gate) * up; X = [gate | up], k wide each
            g = tl.load(X + ks, mask=k_ok, other=0.0).to(tl.float32)
            u = tl.load(X + k + ks, mask=k_ok, other=0.0).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            xk = (act * u).to(dtype).to(tl.float32)
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


def tile(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an ``n x k`` weight (tools/tune_gemv.py, H200):
    8 rows per program while that still leaves 2+ programs per SM, 32 above; 8 KB of weight per
    pipeline stage; a deeper pipeline on long rows."""
    if TILE is not None:
        return TILE
    if n <= 4096:
        return 8, min(512, next_pow2(k)), 4, 4 if k >= 8192 else 3
    return 32, min(256, next_pow2(k)), 4, 3


TILE: tuple[int, int, int, int] | None = None  # forced tile (tests, tools/tune_gemv.py)


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
    block_n, block_k, warps, stages = tile(n, k)
    _gemv_kernel[(cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_w if norm_w is not None else x, w,
        bias if bias is not None else w, out, res_out, n, k, w.stride(0), eps,
        PROLOGUE=prologue, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, num_warps=warps,
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

"""Fused elementwise steps of the decoder: residual add + RMSNorm, RoPE in place, SiLU-and-multiply,
and greedy sampling (argmax over the vocabulary).

In plain PyTorch these are ~40 small launches per layer; a batch-1 decode step of a 16-layer model
would spend more time launching them than reading the weights. On a GPU each is one Triton kernel;
elsewhere the same math runs as PyTorch ops (the reference the kernels are tested against, under the
interpreter). Rounding follows transformers: the residual sum is rounded to the activation dtype
before it is normalized; the norm is computed in fp32, rounded, then scaled by the weight; SiLU is
rounded before the multiply. RoPE is applied in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedflash.ops.launch import cdiv, next_pow2


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


@triton.jit
def _rope_kernel(
    X,  # [T, >= num_heads * 2 * HALF] rows of q heads then k heads (e.g. the fused qkv output)
    Cos, Sin,  # [max_len, 2 * HALF] fp32
    Pos,  # [T] int64
    stride_t, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    mask = (heads[:, None] < num_heads) & d_ok[None, :]
    pos = tl.load(Pos + t)
    c = tl.load(Cos + pos * (2 * HALF) + d, mask=d_ok, other=0.0)[None, :]
    s = tl.load(Sin + pos * (2 * HALF) + d, mask=d_ok, other=0.0)[None, :]
    p = X + t * stride_t + heads[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p, (x1 * c - x2 * s).to(X.dtype.element_ty), mask=mask)
    tl.store(p + HALF, (x2 * c + x1 * s).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(
    GateUp,  # [T, 2 * n]: gate then up
    Out,  # [T, n]
    stride_g, stride_o, n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + row * stride_g + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * u).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _argmax_chunks_kernel(
    X,  # [R, V] logits
    Val, Idx,  # [R, C] fp32 / int32: max and its first index in each chunk of BLOCK columns
    stride_x, n, num_chunks,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN counts as the largest, as in torch.argmax
    m = tl.max(x, axis=0)
    tl.store(Val + row * num_chunks + chunk, m)
    tl.store(Idx + row * num_chunks + chunk, tl.min(tl.where((x == m) & (cols < n), cols, n), axis=0))


@triton.jit
def _argmax_merge_kernel(Val, Idx, Out, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < num_chunks
    v = tl.load(Val + row * num_chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(Idx + row * num_chunks + c, mask=ok, other=0x7FFFFFFF)
    m = tl.max(v, axis=0)
    tl.store(Out + row, tl.min(tl.where(ok & (v == m), i, 0x7FFFFFFF), axis=0).to(tl.int64))


FORCE_KERNELS: bool | None = None  # None: kernels on a GPU, PyTorch elsewhere; tests force either


def use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda if FORCE_KERNELS is None else FORCE_KERNELS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``norm(x + residual)`` and ``x + residual`` (or ``norm(x)`` and ``x`` without a residual).
    x, residual: ``[T, H]``; returns ``(out [T, H], new_residual [T, H])``."""
    if not use_kernels(x):
        if residual is not None:
            x = x + residual
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return weight * y, x
    t, h = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if t:
        _rms_norm_kernel[(t,)](
            x, residual if residual is not None else x, weight, out, res_out,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
            h, eps, HAS_RES=residual is not None, BLOCK=next_pow2(h),
            num_warps=8 if h >= 2048 else 4,
        )
    return out, res_out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
          head_dim: int) -> None:
    """Rotate, in place, the first ``num_heads`` heads of every row of ``x [T, >= num_heads * D]``
    (rotate-half layout) by the angles of ``positions [T]``; ``cos``/``sin`` ``[max_len, D]`` fp32."""
    t = x.shape[0]
    if not use_kernels(x):
        view = x[:, : num_heads * head_dim].view(t, num_heads, head_dim)
        xf = view.float()
        x1, x2 = xf.chunk(2, dim=-1)
        half = head_dim // 2
        c, s = cos[positions, None, :half], sin[positions, None, :half]
        view.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))
        return
    block_h = min(16, next_pow2(num_heads))
    if t:
        _rope_kernel[(t, cdiv(num_heads, block_h))](
            x, cos, sin, positions, x.stride(0), num_heads,
            HALF=head_dim // 2, BLOCK_H=block_h, BLOCK_HALF=next_pow2(head_dim // 2),
        )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2n]`` (gate first) -> ``[T, n]``."""
    n = gate_up.shape[-1] // 2
    if not use_kernels(gate_up):
        gate, up = gate_up.split(n, dim=-1)
        return F.silu(gate) * up
    t = gate_up.shape[0]
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(n))
    if t:
        _silu_mul_kernel[(t, cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out


ARGMAX_CHUNK = 4096


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: the first index of each row's maximum of ``logits [R, V]`` -> int64 ``[R]``.

    ``torch.argmax`` reduces a 128K-entry row in one thread block (~27 µs on an H200 at batch 1); here
    chunks of ``ARGMAX_CHUNK`` columns reduce in parallel, then one small launch merges them
    (first index of the maximum kept, as torch does; NaN counts as the largest)."""
    if not use_kernels(logits):
        return logits.argmax(-1)
    r, v = logits.shape
    chunks = cdiv(v, ARGMAX_CHUNK)
    val = torch.empty((r, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((r, chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r:
        _argmax_chunks_kernel[(r, chunks)](logits, val, idx, logits.stride(0), v, chunks, BLOCK=ARGMAX_CHUNK,
                                           num_warps=8)
        _argmax_merge_kernel[(r,)](val, idx, out, chunks, BLOCK=next_pow2(chunks))
    return out

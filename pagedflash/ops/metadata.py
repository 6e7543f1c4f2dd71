"""Varlen metadata made safe on the device, for kernels that trust what they read.

:func:`varlen_bounds` checks ``cu_seqlens_q``, ``cu_seqlens_k`` and (paged) the block table of a
varlen call, one program per sequence, without the host reading anything, and writes each
sequence's ``(start, end)`` query and key rows as the kernel should use them: as given for a valid
sequence, ``(0, 0)`` (nothing to read or write) for an invalid one, whose output rows (within
``[0, total_q)``) and LSE it fills with NaN and whose fault it reports in
:func:`pagedflash.validate.fault_buffer`. A sequence is valid when

- ``cu_q`` as a whole starts at 0, ends at ``total_q``, never decreases and holds no sequence
  longer than ``max_seqlen_q``, and the K/V descales (fp8) are finite and > 0: otherwise every
  sequence is invalid and every row NaN (as in the portable kernel);
- its queries ``cu_q[b] .. cu_q[b+1]`` are ordered, and so are the offsets next to them
  (``cu_q[b-1] <= cu_q[b]``, ``cu_q[b+1] <= cu_q[b+2]``: an offset out of order invalidates the
  sequences on both sides, whose rows would overlap), inside ``[0, total_q)``, at most
  ``max_seqlen_q`` long, with ``cu_q[0] = 0`` and ``cu_q[B] = total_q`` (the first and the last
  sequence check those);
- its keys ``cu_k[b] .. cu_k[b+1]`` are ordered in the same sense, with ``cu_k[0] = 0``: packed, inside
  ``[0, total_k)`` with ``cu_k[B] = total_k``; paged, at most the block table's ``columns x
  page_size`` long, and every page id its keys use is in ``[0, num_blocks)``.

The Gluon prefill kernel reads these pairs (:mod:`pagedflash.ops.prefill_hopper`): one extra launch
of B small programs in front of a prefill, instead of a check in each of its partitions. Its
reference is :func:`pagedflash.reference.varlen_bounds_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import _jit, scratch
from pagedflash.ops.utils import next_pow2

_FAULT_Q: tl.constexpr = tl.constexpr(validate.FAULT_CU_SEQLENS_Q)
_FAULT_K: tl.constexpr = tl.constexpr(validate.FAULT_CU_SEQLENS_K)
_FAULT_PAGES: tl.constexpr = tl.constexpr(validate.FAULT_BLOCK_TABLE)


@triton.jit
def _varlen_bounds_kernel(
    CuQ, CuK, BlockTable, PairsQ, PairsK, Out, Lse, Faults, KDescale, VDescale,
    batch, total_q, total_k, max_seqlen_q, num_pages, num_blocks, num_heads, num_kds, num_vds,
    stride_tb, stride_ot, stride_oh, stride_lh, stride_lt, stride_kds, stride_vds,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, WRITE_LSE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0)
    q0 = tl.load(CuQ + b)
    q1 = tl.load(CuQ + b + 1)
    k0 = tl.load(CuK + b)
    k1 = tl.load(CuK + b + 1)
    # a neighbour out of order makes rows overlap: both sides of the step are invalid
    q_prev = tl.load(CuQ + b - 1, mask=b > 0, other=0)
    q_next = tl.load(CuQ + b + 2, mask=b < batch - 1, other=total_q)
    k_prev = tl.load(CuK + b - 1, mask=b > 0, other=0)
    k_next = tl.load(CuK + b + 2, mask=b < batch - 1, other=2**31 - 1)
    ok_q = (q_prev <= q0) & (q0 >= 0) & (q1 >= q0) & (q1 <= q_next) & (q1 <= total_q) & (q1 - q0 <= max_seqlen_q)
    ok_q = ok_q & ((b > 0) | (q0 == 0)) & ((b < batch - 1) | (q1 == total_q))
    ok_k = (k_prev <= k0) & (k0 >= 0) & (k1 >= k0) & (k1 <= k_next) & ((b > 0) | (k0 == 0))
    ok_pages = True
    if PAGED:
        ok_k = ok_k & (k1 - k0 <= num_pages * PAGE_SIZE)
        used = tl.where(ok_k, tl.cdiv(k1 - k0, PAGE_SIZE), 0)
        bad = 0
        for p0 in range(0, used, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            ids = tl.load(BlockTable + b.to(tl.int64) * stride_tb + p, mask=p < used, other=0)
            bad += tl.sum(((ids < 0) | (ids >= num_blocks)).to(tl.int32), axis=0)
        ok_pages = bad == 0
    else:
        ok_k = ok_k & (k1 <= total_k) & ((b < batch - 1) | (k1 == total_k))
    _jit.report_fault(Faults, _FAULT_Q, b, ok_q == 0)
    _jit.report_fault(Faults, _FAULT_K, b, ok_k == 0)
    _jit.report_fault(Faults, _FAULT_PAGES, b, ok_pages == 0)
    # cu_seqlens_q as a whole (the portable kernel's rule): from 0 to total_q, never decreasing, no
    # sequence past max_seqlen_q; otherwise every sequence is invalid and every row NaN
    steps = 0
    for i0 in range(0, batch, BLOCK_P):
        i = i0 + tl.arange(0, BLOCK_P)
        lo = tl.load(CuQ + i, mask=i < batch, other=0)
        hi = tl.load(CuQ + i + 1, mask=i < batch, other=0)
        steps += tl.sum(((hi < lo) | (hi - lo > max_seqlen_q)).to(tl.int32), axis=0)
    all_q = (steps == 0) & (tl.load(CuQ) == 0) & (tl.load(CuQ + batch) == total_q)
    # K/V descales finite and > 0 (a zero or negative one gives plausible numbers): else all NaN
    bad_scale = 0
    for i0 in range(0, num_kds, BLOCK_P):
        i = i0 + tl.arange(0, BLOCK_P)
        x = tl.load(KDescale + i * stride_kds, mask=i < num_kds, other=1.0)
        bad_scale += tl.sum((~((x > 0.0) & (x < float("inf")))).to(tl.int32), axis=0)
    for i0 in range(0, num_vds, BLOCK_P):
        i = i0 + tl.arange(0, BLOCK_P)
        x = tl.load(VDescale + i * stride_vds, mask=i < num_vds, other=1.0)
        bad_scale += tl.sum((~((x > 0.0) & (x < float("inf")))).to(tl.int32), axis=0)
    everything = all_q & (bad_scale == 0)
    ok = ok_q & ok_k & ok_pages & everything
    tl.store(PairsQ + 2 * b, tl.where(ok, q0, 0))
    tl.store(PairsQ + 2 * b + 1, tl.where(ok, q1, 0))
    tl.store(PairsK + 2 * b, tl.where(ok, k0, 0))
    tl.store(PairsK + 2 * b + 1, tl.where(ok, k1, 0))
    if ok == 0:  # NaN in the rows the sequence names, those inside the output (all: program 0)
        lo = tl.minimum(tl.maximum(q0, 0), total_q)
        hi = tl.maximum(tl.minimum(q1, total_q), lo)
        if everything == 0:
            lo = tl.where(b == 0, 0, total_q)
            hi = total_q
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
        nan = tl.full([BLOCK_H, BLOCK_D], float("nan"), tl.float32).to(Out.dtype.element_ty)
        o_ptr = Out + lo.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
        l_ptr = Lse + lo.to(tl.int64) * stride_lt + offs_h * stride_lh
        for _ in range(lo, hi):  # pointers advance a row at a time (64-bit arithmetic)
            tl.store(o_ptr, nan, mask=mask)
            o_ptr += stride_ot
            if WRITE_LSE:
                tl.store(l_ptr, tl.full([BLOCK_H], float("nan"), tl.float32), mask=offs_h < num_heads)
                l_ptr += stride_lt


def varlen_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, block_table: torch.Tensor | None,
                  out: torch.Tensor, lse: torch.Tensor | None, *, total_k: int, max_seqlen_q: int,
                  num_blocks: int = 0, page_size: int = 0, k_descale: torch.Tensor | None = None,
                  v_descale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pairs_q, pairs_k)``: int32 ``[B, 2]`` ``(start, end)`` rows per sequence, ``(0, 0)`` for an
    invalid one (whose rows of ``out [total_q, Hq, D]`` and ``lse [Hq, total_q]`` become NaN and whose
    fault is recorded). ``total_k``: packed keys (``k.shape[0]``); paged: ``num_blocks`` and
    ``page_size`` of the cache, the capacity from ``block_table``'s columns. Scratch buffers: valid
    until the next call on this stream."""
    batch = cu_seqlens_q.shape[0] - 1
    pairs_q, pairs_k = scratch.buffers((((batch, 2), torch.int32), ((batch, 2), torch.int32)), out.device)
    paged = block_table is not None
    table = block_table if paged else cu_seqlens_k
    num_heads, head_dim = out.shape[1], out.shape[2]
    kds, vds = (cu_seqlens_q if t is None else t for t in (k_descale, v_descale))
    _varlen_bounds_kernel[(batch,)](
        cu_seqlens_q, cu_seqlens_k, table, pairs_q, pairs_k, out, out if lse is None else lse,
        validate.fault_buffer(out.device), kds, vds,
        batch, out.shape[0], total_k, max_seqlen_q, block_table.shape[1] if paged else 0, num_blocks, num_heads,
        0 if k_descale is None else k_descale.numel(), 0 if v_descale is None else v_descale.numel(),
        table.stride(0), out.stride(0), out.stride(1), *(lse.stride() if lse is not None else (0, 0)),
        *((t.stride(0) if t is not None and t.dim() else 0) for t in (k_descale, v_descale)),
        PAGED=paged, PAGE_SIZE=max(page_size, 1), WRITE_LSE=lse is not None, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim), BLOCK_P=128,
    )
    return pairs_q, pairs_k

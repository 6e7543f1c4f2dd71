"""The pieces of the attention kernel (:mod:`pagedflash.ops.attention`): the varlen grid's map from
a program to its sequence and the check of the offsets it is laid out from, the page lookup of a
key tile, K/V addresses, the loop that folds a range of key tiles into a running softmax state, and
the batch-invariant mode's split positions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedflash.ops import _jit
from pagedflash.ops._jit import FLT_MIN, LOG2E, NEG_INF


@triton.jit
def find_seq(CuSeqlensQ, pid, batch, BLOCK_Q: tl.constexpr):
    """Varlen grid: the sequence whose tiles include program ``pid``. Sequence ``b`` owns programs
    ``[cu[b] // BLOCK_Q + b, cu[b+1] // BLOCK_Q + b + 1)`` (at least one each), so no host pass over
    the lengths is needed to lay out the grid."""
    lo = 0
    hi = batch - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(CuSeqlensQ + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def pages(BlockTable, b, stride_tb, start_n, seqlen_k, offs_n, num_blocks, PAGE_SIZE: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """Block-table entries of the key tile at ``start_n``: one scalar when the tile lies inside one
    page, else one per key (``[BLOCK_N]``); 0 for a tile or keys past the sequence (never loaded).
    Bounded by the sequence, not by the range being walked: keys of a range's last tile past its
    end are loaded (and masked in the scores), so they must come from their own page.

    Returns ``(ids, bad)``: an id outside ``[0, num_blocks)`` is flagged in ``bad`` and replaced by
    0, so that no address leaves the pool (the rows that read it end NaN)."""
    if PAGE_SIZE % BLOCK_N == 0:
        blk = tl.load(BlockTable + b * stride_tb + start_n // PAGE_SIZE, mask=start_n < seqlen_k, other=0)
    else:
        pos = start_n + offs_n
        blk = tl.load(BlockTable + b * stride_tb + pos // PAGE_SIZE, mask=pos < seqlen_k, other=0)
    bad = blk.to(tl.uint32, bitcast=True) >= num_blocks.to(tl.uint32)  # one compare: negative ids wrap high
    return tl.where(bad, 0, blk), bad


@triton.jit
def any_bad_page(page_bad, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Whether :func:`attend_range`'s accumulated ``page_bad`` flags hold a bad page id: one flag, from
    the per-key flags when tiles span pages."""
    bad = page_bad
    if PAGE_SIZE % BLOCK_N != 0:
        bad = tl.max(page_bad.to(tl.int32), 0) > 0
    return bad


@triton.jit
def kv_offsets(pos, blk, b, k_row0, stride_b, stride_t, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets ``[BLOCK_N]`` (int64) of key positions ``pos`` of sequence ``b``: dense, row
    ``k_row0 + pos`` of batch ``b``; paged, slot ``pos % PAGE_SIZE`` of page ``blk``."""
    if PAGED:
        return blk.to(tl.int64) * stride_b + (pos % PAGE_SIZE).to(tl.int64) * stride_t
    else:
        return b.to(tl.int64) * stride_b + (k_row0 + pos).to(tl.int64) * stride_t


@triton.jit
def attend_range(
    acc, l_i, m_i, page_bad, q, K, V, lo, hi,
    b, k_row0, seqlen_k, delta, q_pos, window_left, window_right, qk_scale, sm_scale, softcap,
    BlockTable, stride_tb, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt,
    offs_n, offs_d, d_ok,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, FP8_CVT: tl.constexpr,
    EXACT: tl.constexpr = False,
):
    """Fold key tiles ``[lo, hi)`` (lo tile-aligned) into the running softmax state. K and V are
    pointers, or (``USE_TMA``) tensor descriptors: over this sequence's ``[seqlen_k, D]`` rows, whose
    loads the copy engine bounds by the sequence itself (zero fill past the end), or over the page
    pool's ``[num_blocks * page_size, D]`` rows, a tile never crossing a page; there the masked
    tiles zero the values of slots past the sequence (their keys are masked by the scores).

    ``page_bad`` (paged) accumulates whether a page id fetched was outside the pool (read as page 0
    instead): a scalar, or ``[BLOCK_N]`` when tiles span pages; per tile one compare and one OR.

    ``EXACT`` (the batch-invariant mode): a visible key's probability gets the same bits from a masked
    and an unmasked tile: the mask goes on the raw scores, the row max is scaled once after it (a
    rounding is monotonic: the same max), and ``exp2(fma(s, scale, -max))`` is explicit, where the
    compiler would otherwise fuse the unmasked tile's scale and subtraction but not the masked one's.
    fp8 K is converted by the instruction (``FP8_CVT``) as V is: a plain cast lets the compiler give a
    warp's MMA (the decode tile) the operand layout of the 8-bit source, whose order over the head dim
    differs from the 16-bit one, and so its scores' bits from a warpgroup's (the mode's 64-row tile)."""
    if PAGED:  # the table entries of the first tile; each step fetches the next tile's ahead of use
        blk_next, bad = pages(BlockTable, b, stride_tb, lo, seqlen_k, offs_n, num_blocks, PAGE_SIZE, BLOCK_N)
        page_bad = page_bad | bad
    for start_n in range(lo, hi, BLOCK_N):
        pos = start_n + offs_n
        n_ok = pos < seqlen_k
        kv_mask = (n_ok[:, None] | (not MASKED)) & (d_ok[None, :] | EVEN_D)
        BOUNDED: tl.constexpr = MASKED or not EVEN_D  # the interior of an even-D range loads unmasked
        blk = 0
        if PAGED:  # a load issued a whole tile before its use: the K/V addresses never wait on it
            blk = blk_next
            blk_next, bad = pages(BlockTable, b, stride_tb, start_n + BLOCK_N, seqlen_k, offs_n, num_blocks,
                                   PAGE_SIZE, BLOCK_N)
            page_bad = page_bad | bad
        if USE_TMA:
            if PAGED:  # the tile's first pool row
                row = blk * PAGE_SIZE + start_n % PAGE_SIZE
            else:
                row = start_n
            k = K.load([row, 0])
        else:
            k_off = kv_offsets(pos, blk, b, k_row0, stride_kb, stride_kt, PAGED, PAGE_SIZE)
            if BOUNDED:
                k = tl.load(K + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            else:
                k = tl.load(K + k_off[:, None] + offs_d[None, :])
        if FP8_CVT and EXACT:  # K converted first too (the docstring's EXACT)
            k = _jit.fp8_to_f16(k)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        if EXACT:  # (a scale that underflowed to 0 would make the masked -inf scores NaN: the least normal)
            scale = tl.maximum(qk_scale, FLT_MIN)
            if HAS_SOFTCAP:
                s = _jit.soft_cap(s * sm_scale, softcap)
                scale = LOG2E
            if MASKED:
                ok = _jit.visible(q_pos[:, None], pos[None, :], seqlen_k, delta, window_left, window_right,
                                  HAS_LEFT, HAS_RIGHT)
                s = tl.where(ok, s, NEG_INF)
            m_i, l_i, acc, p = _jit.online_softmax_step_scaled(m_i, l_i, acc, s, scale)
        else:
            if HAS_SOFTCAP:
                s = _jit.soft_cap(s * sm_scale, softcap) * LOG2E
            else:
                s = s * qk_scale
            if MASKED:
                ok = _jit.visible(q_pos[:, None], pos[None, :], seqlen_k, delta, window_left, window_right,
                                  HAS_LEFT, HAS_RIGHT)
                s = tl.where(ok, s, NEG_INF)
            m_i, l_i, acc, p = _jit.online_softmax_step(m_i, l_i, acc, s)
        if USE_TMA:
            v = V.load([row, 0])
            if PAGED and MASKED:  # slots of the last page past the sequence hold stale values
                v = tl.where(n_ok[:, None], v, 0.0)
        else:
            v_off = kv_offsets(pos, blk, b, k_row0, stride_vb, stride_vt, PAGED, PAGE_SIZE)
            if BOUNDED:
                v = tl.load(V + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            else:
                v = tl.load(V + v_off[:, None] + offs_d[None, :])
        if FP8_CVT:  # fp8 V converted here, before its move into the dot's operand layout
            v = _jit.fp8_to_f16(v)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i, page_bad


@triton.jit
def split_start(s, SPLIT_N: tl.constexpr, HEAD_N: tl.constexpr, HEAD_KEYS: tl.constexpr, MID_N: tl.constexpr,
                MID_KEYS: tl.constexpr):
    """First key of split ``s`` under the batch-invariant rule (:class:`pagedflash.ops.launch.SplitRule`):
    the first ``HEAD_KEYS`` keys in splits of ``HEAD_N``, then up to key ``MID_KEYS`` (``HEAD_KEYS``:
    none) in splits of ``MID_N``, the rest in splits of ``SPLIT_N``."""
    NH: tl.constexpr = HEAD_KEYS // HEAD_N
    NM: tl.constexpr = NH + (MID_KEYS - HEAD_KEYS) // MID_N
    return tl.where(s < NH, s * HEAD_N,
                    tl.where(s < NM, HEAD_KEYS + (s - NH) * MID_N, MID_KEYS + (s - NM) * SPLIT_N))


@triton.jit
def split_of(pos, SPLIT_N: tl.constexpr, HEAD_N: tl.constexpr, HEAD_KEYS: tl.constexpr, MID_N: tl.constexpr,
             MID_KEYS: tl.constexpr):
    """The split (:func:`split_start`) holding key ``pos`` (``pos >= 0``)."""
    NH: tl.constexpr = HEAD_KEYS // HEAD_N
    NM: tl.constexpr = NH + (MID_KEYS - HEAD_KEYS) // MID_N
    return tl.where(pos < HEAD_KEYS, pos // HEAD_N,
                    tl.where(pos < MID_KEYS, NH + (pos - HEAD_KEYS) // MID_N, NM + (pos - MID_KEYS) // SPLIT_N))


@triton.jit
def offsets_fault(Cu, batch, total, max_len, CHUNK: tl.constexpr):
    """-1 when ``Cu[0..batch]`` are the offsets of ``batch`` sequences packed into ``total`` rows
    (from 0, non-decreasing, to ``total``, none longer than ``max_len``), else the last sequence that
    breaks the rule. The varlen grid (:func:`find_seq`) maps programs onto rows only for such
    offsets, so every program checks them all (``batch + 1`` int32, in chunks of ``CHUNK``)."""
    worst = batch * 0 - 1
    for c in range(0, batch, CHUNK):
        i = c + tl.arange(0, CHUNK)
        in_batch = i < batch
        lo = tl.load(Cu + i, mask=in_batch, other=0)
        hi = tl.load(Cu + i + 1, mask=in_batch, other=0)
        bad = in_batch & ((hi < lo) | (hi - lo > max_len))  # hi - lo: both >= 0 once the offsets are ordered from 0
        worst = tl.maximum(worst, tl.max(tl.where(bad, i, -1), 0))
    worst = tl.where(tl.load(Cu) != 0, tl.maximum(worst, 0), worst)
    return tl.where(tl.load(Cu + batch) != total, batch - 1, worst)

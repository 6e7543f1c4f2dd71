"""The one attention kernel behind every public entry point.

One program computes one tile of query rows against one KV head, streaming K/V tiles through an
online softmax (FlashAttention-2). Constexpr switches select, at compile time only:

- ``VARLEN_Q`` / ``VARLEN_K``: packed sequences (``cu_seqlens``) or a dense batch dimension;
- ``HAS_SEQUSED``: per-sequence KV lengths from a tensor (the KV-cache API's ``cache_seqlens``);
- ``PAGED``: keys/values read through a block table from ``[num_blocks, page_size, Hkv, D]`` pages
  (the only difference is :func:`~pagedflash.ops.attention_tiles.kv_offsets`, the address helper);
- ``G_PACK``: how many query heads that share a KV head are packed into the rows of one tile
  (1 for prefill; the whole group for decode, so each KV byte is read once per group);
- ``SPLIT_KV``: the KV range of a tile split over ``num_splits`` programs (flash-decoding); each
  split writes a partial (out, lse) and :mod:`pagedflash.ops.combine` merges them. The count is a
  runtime argument, so a serving engine whose split count varies step to step compiles once;
- ``HAS_LEFT`` / ``HAS_RIGHT`` / ``HAS_SOFTCAP``: sliding window, causal (``right == 0``), softcap;
- ``HAS_K_DESCALE`` / ``HAS_V_DESCALE``: K/V stored scaled (an fp8 cache): the real key is
  ``stored * k_descale[kv head]``. The key descale is folded into the score scale of the program's
  KV head and the value descale into its output, so the loop only converts the loaded K/V tiles to
  q's dtype for the dots (a no-op for 16-bit caches);
- ``HAS_SINKS``: one extra logit per query head in the softmax denominator (attention sinks), folded
  in once per row at the end (under split-KV by split 0 only, so the combine counts it once; in
  batch-invariant mode by slot 0's split);
- ``INVARIANT``: batch-invariant mode (:mod:`pagedflash.batch_invariance`): keys in splits at
  absolute positions (the first ``HEAD_KEYS`` in splits of ``HEAD_N``, up to ``MID_KEYS`` in splits of
  ``MID_N``, then of ``SPLIT_N``), each split from a fresh state through the masked loop (EXACT
  arithmetic), merged left to right (split programs share a row's splits, a partial each; the combine
  merges them in the same order);
- ``FP8_CVT``: fp8 V tiles (and K tiles in the batch-invariant mode) convert to fp16 by the GPU's
  instruction before they move into the dot's operand layout (:func:`pagedflash.ops._jit.fp8_to_f16`;
  NVIDIA sm_89+).

The KV range of a tile is walked in three stages: masked tiles at the start (left window edge),
unmasked tiles in the middle (no mask arithmetic, no bounds on loads), masked tiles at the end (the
causal diagonal and the ragged end of the sequence). Every load is bounded by the sequence length.

Metadata values are the kernel's to check (the host reads none): every program checks the offsets
of ``cu_seqlens_q`` (its grid is laid out from them), its sequence's ``cu_seqlens_k`` or
``seqused_k`` against the tensors' bounds, and each page id as it is fetched. Invalid metadata
gives NaN output rows and LSE (reading no key, or page 0 in place of an id outside the pool) and a
record in :func:`pagedflash.validate.fault_buffer`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import _jit, attention_launch, combine, launch, scratch
from pagedflash.ops._jit import LOG2E, NEG_INF
from pagedflash.ops.attention_plan import Plan, make_plan, plan_key
from pagedflash.ops.attention_tiles import (
    any_bad_page,
    attend_range,
    find_seq,
    offsets_fault,
    split_of,
    split_start,
)
from pagedflash.ops.launch import LaunchConfig
from pagedflash.ops.utils import PlanCache, new_output

# Integer arguments that change from call to call in a serving loop. Triton would otherwise compile a
# variant per "== 1 / divisible by 16 / other" state of each (a second-long stall mid-request); none
# of them feeds an address whose alignment matters.
_RUNTIME_INTS = ["batch", "seqlen_q", "seqlen_k", "num_q_tiles", "num_splits", "stride_tb", "window_left",
                 "window_right", "total_q", "max_seqlen_q", "kv_limit", "min_seqused_k", "num_blocks"]

_FAULT_Q: tl.constexpr = tl.constexpr(validate.FAULT_CU_SEQLENS_Q)
_FAULT_CU_K: tl.constexpr = tl.constexpr(validate.FAULT_CU_SEQLENS_K)
_FAULT_SEQUSED: tl.constexpr = tl.constexpr(validate.FAULT_SEQLENS_K)
_FAULT_PAGES: tl.constexpr = tl.constexpr(validate.FAULT_BLOCK_TABLE)
_CU_CHUNK: tl.constexpr = tl.constexpr(128)  # cu_seqlens_q entries checked per load
INT32_MAX = 2**31 - 1
_INT32_MAX: tl.constexpr = tl.constexpr(INT32_MAX)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _attention_kernel(
    Q,  # [B, Sq, Hq, D] or [total_q, Hq, D]
    K,  # [B, Sk, Hkv, D], [total_k, Hkv, D] or pages [num_blocks, page_size, Hkv, D]
    V,  # like K
    Out,  # like Q
    Lse,  # [B, Hq, Sq] or [Hq, total_q], fp32
    OutPart,  # [num_splits, tokens, Hq, D] fp32 (split-KV only)
    LsePart,  # [num_splits, tokens, Hq] fp32 (split-KV only; batch-invariant: [num_splits + 1, ...])
    CuSeqlensQ,  # [B + 1] int32 (varlen)
    CuSeqlensK,  # [B + 1] int32 (varlen K or paged)
    SequsedK,  # [B] int32 (KV-cache lengths)
    BlockTable,  # [B, max_blocks] int32 (paged)
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh, stride_lt,
    stride_tb,
    stride_ps, stride_pt, stride_ph,
    stride_lps, stride_lpt,
    batch, seqlen_q, seqlen_k, kv_rows, num_q_tiles, num_splits,
    sm_scale, softcap, window_left, window_right,
    Sinks,  # [Hq] fp32 (HAS_SINKS)
    KDescale, VDescale,  # [Hkv] fp32, or one value with stride 0 (HAS_K_DESCALE / HAS_V_DESCALE)
    stride_sink, stride_kds, stride_vds,
    Faults,  # int32 [NUM_FAULTS]: validate.fault_buffer of q's device
    total_q, max_seqlen_q,  # packed query rows and the longest sequence allowed (VARLEN_Q)
    kv_limit,  # packed keys (VARLEN_K dense); else the KV capacity of a sequence (S_max, or table columns x page)
    min_seqused_k,  # the least valid seqused_k (HAS_SEQUSED: the keys appended just before)
    num_blocks,  # pages in the pool (PAGED)
    GROUP: tl.constexpr, G_PACK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT_KV: tl.constexpr,
    VARLEN_Q: tl.constexpr, VARLEN_K: tl.constexpr, HAS_SEQUSED: tl.constexpr, PAGED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_K_DESCALE: tl.constexpr, HAS_V_DESCALE: tl.constexpr, FP8_CVT: tl.constexpr,
    INVARIANT: tl.constexpr, SPLIT_N: tl.constexpr, HEAD_N: tl.constexpr, HEAD_KEYS: tl.constexpr,
    MID_N: tl.constexpr, MID_KEYS: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PACK  # query tokens per tile
    pid_q = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)

    # --- which sequence and which tile of its queries. Invalid cu_seqlens_q (see offsets_fault):
    # program p covers rows [p * BLOCK_Q, (p + 1) * BLOCK_Q) of the output, which it makes NaN.
    q_ok = tl.full([], 1, tl.int1)
    if VARLEN_Q:
        q_fault = offsets_fault(CuSeqlensQ, batch, total_q, max_seqlen_q, _CU_CHUNK)
        q_ok = q_fault < 0
        if num_q_tiles == 1:  # no sequence longer than a tile (decode): program b is sequence b's one tile
            b = tl.where(q_ok, pid_q, 0)
            q_start = tl.where(q_ok, tl.load(CuSeqlensQ + b), 0)
            tile = tl.where(q_ok, 0, pid_q)
        else:
            b = tl.where(q_ok, find_seq(CuSeqlensQ, pid_q, batch, BLOCK_Q), 0)
            q_start = tl.where(q_ok, tl.load(CuSeqlensQ + b), 0)
            tile = tl.where(q_ok, pid_q - (q_start // BLOCK_Q + b), pid_q)
        seqlen_q = tl.where(q_ok, tl.load(CuSeqlensQ + b + 1), total_q) - q_start
        tok_base = q_start
        _jit.report_fault(Faults, _FAULT_Q, q_fault, (q_fault >= 0) & (pid_q == 0) & (pid_h == 0) & (split == 0))
    else:
        b = pid_q // num_q_tiles
        tile = pid_q % num_q_tiles
        q_start = 0
        tok_base = b * seqlen_q
    q0 = tile * BLOCK_Q
    if q0 >= seqlen_q:
        return

    # --- the sequence's keys; invalid metadata: no key read, NaN rows and a fault (reported once per
    # sequence, by its first program)
    first = q_ok & (tile == 0) & (pid_h == 0) & (split == 0)
    k_row0 = b * 0
    k_ok = q_ok
    if VARLEN_K:  # ordered offsets, and ordered with the neighbours' (else key ranges overlap)
        k_row0 = tl.load(CuSeqlensK + b)
        k_end = tl.load(CuSeqlensK + b + 1)
        k_prev = tl.load(CuSeqlensK + b - 1, mask=b > 0, other=0)
        k_next = tl.load(CuSeqlensK + b + 2, mask=b < batch - 1, other=_INT32_MAX)
        cu_k_ok = (k_prev <= k_row0) & (k_row0 >= 0) & (k_row0 <= k_end) & (k_end <= k_next)
        cu_k_ok = cu_k_ok & ((b > 0) | (k_row0 == 0))
        if PAGED:  # lengths within the table's pages
            cu_k_ok = cu_k_ok & (k_end - k_row0 <= kv_limit)
        else:  # rows within the packed keys, all of them used
            cu_k_ok = cu_k_ok & (k_end <= kv_limit) & ((b < batch - 1) | (k_end == kv_limit))
        _jit.report_fault(Faults, _FAULT_CU_K, b, first & (cu_k_ok == 0))
        k_ok = k_ok & cu_k_ok
        seqlen_k = k_end - k_row0
    if HAS_SEQUSED:
        seqlen_k = tl.load(SequsedK + b)
        used_ok = (seqlen_k >= min_seqused_k) & (seqlen_k <= kv_limit)
        _jit.report_fault(Faults, _FAULT_SEQUSED, b, first & (used_ok == 0))
        k_ok = k_ok & used_ok
    seqlen_k = tl.where(k_ok, seqlen_k, 0)
    k_row0 = tl.where(k_ok, k_row0, 0)
    delta = seqlen_k - seqlen_q

    # --- rows of this tile: (query token, query head) pairs; heads of one KV group packed
    kvh = pid_h // (GROUP // G_PACK)
    h0 = kvh * GROUP + (pid_h % (GROUP // G_PACK)) * G_PACK
    offs_m = tl.arange(0, BLOCK_M)
    row_tok = offs_m // G_PACK
    row_head = h0 + offs_m % G_PACK
    q_pos = q0 + row_tok
    row_ok = (row_tok < BLOCK_Q) & (q_pos < seqlen_q)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    q_rows = b.to(tl.int64) * stride_qb + (q_start + q_pos).to(tl.int64) * stride_qt + row_head * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # --- key range: [lo, hi) touches any visible key; [full_lo, full_hi) is visible to every row
    q_last = tl.minimum(q0 + BLOCK_Q, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if HAS_LEFT:
        lo = tl.maximum(q0 + delta - window_left, 0)
        full_lo = tl.maximum(q_last + delta - window_left, 0)
    if HAS_RIGHT:
        hi = tl.maximum(tl.minimum(q_last + delta + window_right + 1, seqlen_k), 0)
        full_hi = tl.minimum(q0 + delta + window_right + 1, seqlen_k)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.minimum(tl.maximum((full_hi // BLOCK_N) * BLOCK_N, full_lo), hi)
    if SPLIT_KV and not INVARIANT:  # this program's share of the tiles of [lo, hi)
        per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), num_splits) * BLOCK_N
        s_lo = lo + split * per_split
        s_hi = tl.minimum(s_lo + per_split, hi)
    else:
        s_lo = lo
        s_hi = hi

    # --- stream K/V
    scales_ok = q_ok  # descales finite and > 0 (else the rows are NaN: a zero would give plausible numbers)
    if HAS_K_DESCALE:  # scores of stored keys times this head's descale are the real scores
        k_descale = tl.load(KDescale + kvh * stride_kds)
        scales_ok = scales_ok & (k_descale > 0) & (k_descale < float("inf"))
        sm_scale = sm_scale * k_descale
    if K.dtype.element_ty.is_fp8() and Q.dtype.element_ty == tl.bfloat16:
        # fp8 K/V under bf16 queries: both dots run in fp16, to which GPUs convert fp8 pairs in one
        # instruction (to bf16: three, and decode is then bound by the conversions; docs/performance.md
        # v19). The tile's q is scaled by a power of two (exact) that brings its largest element to
        # 2^14, up or down, the scale folded into the score scale; a tile with a non-finite element
        # is not scaled (its rows give what they would in bf16). fp16 holds every fp8 value exactly.
        # The shift is at most 114 for finite bf16 (below 2^128), and held at -126 or above so that
        # 2^-shift stays a finite fp32 (tiles of bf16 subnormals only: rounded as GPUs round them).
        # Batch-invariant mode: a scale per row, so that a row's scores do not depend on its tile.
        if INVARIANT:
            q_max = tl.max(tl.abs(q.to(tl.float32)), axis=1)[:, None]
        else:
            q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
        shift = tl.maximum(tl.ceil(tl.log2(q_max)) - 14.0, -126.0)
        shift = tl.where((q_max > 0.0) & (q_max < float("inf")), shift, 0.0)
        q = (q.to(tl.float32) * tl.exp2(-shift)).to(tl.float16)
        sm_scale = sm_scale * tl.exp2(shift)
    qk_scale = sm_scale * LOG2E
    if HAS_V_DESCALE:
        v_descale = tl.load(VDescale + kvh * stride_vds)
        scales_ok = scales_ok & (v_descale > 0) & (v_descale < float("inf"))
    m_i = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    K += kvh.to(tl.int64) * stride_kh
    V += kvh.to(tl.int64) * stride_vh
    if USE_TMA and PAGED:  # Hopper: descriptors over the pool's rows of this KV head
        tl.static_assert(PAGE_SIZE % BLOCK_N == 0, "paged TMA tiles must not cross a page")
        k_src = tl.make_tensor_descriptor(K, shape=[kv_rows, HEAD_DIM], strides=[stride_kt, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(V, shape=[kv_rows, HEAD_DIM], strides=[stride_vt, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
    elif USE_TMA:  # Hopper: descriptors over this sequence's rows of this KV head
        k_src = tl.make_tensor_descriptor(
            K + b.to(tl.int64) * stride_kb + k_row0.to(tl.int64) * stride_kt, shape=[seqlen_k, HEAD_DIM],
            strides=[stride_kt, 1], block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(
            V + b.to(tl.int64) * stride_vb + k_row0.to(tl.int64) * stride_vt, shape=[seqlen_k, HEAD_DIM],
            strides=[stride_vt, 1], block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_src = K
        v_src = V
    if PAGED and PAGE_SIZE % BLOCK_N != 0:  # one flag per key of a tile (its keys span pages)
        page_bad = offs_n < 0
    else:
        page_bad = pid_q < 0
    if INVARIANT:
        # Batch-invariant mode: the keys in splits at fixed absolute positions (split_start), each from a
        # fresh state through the masked loop with EXACT arithmetic (a masked and an unmasked tile would
        # give a key the same bits), finalized and merged into the row's state left to right from the
        # sink's (0, sink). Split launches: program `split` of the grid's P on its third axis computes the
        # tile's splits split, split + P, ... (any P gives the same bits), each into its own slot of the
        # partials, and program 0 writes their count to the LSE partials' last plane: the combine merges
        # that many slots in the same order, and no program touches a slot past them (a graph sized for
        # the longest row launches slots for it).
        s0 = split_of(lo, SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS)
        s_end = tl.where(hi > lo, split_of(tl.maximum(hi - 1, 0), SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS) + 1,
                         s0 + 1)
        out = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        lse = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
        sink_lse = lse
        if HAS_SINKS:
            sink_lse = tl.load(Sinks + row_head * stride_sink)
        tok = (tok_base + q_pos).to(tl.int64)
        if SPLIT_KV:
            n_slots = tl.minimum(s_end - s0, num_splits)
            slot_step = tl.num_programs(2)
            # a row past max_seqlen_k (which sized the slots) has splits no slot holds: NaN, a fault
            fits = s_end - s0 <= num_splits
            over = q_ok & (pid_h == 0) & (split == 0) & (fits == 0)  # any tile of the sequence
            if HAS_SEQUSED:
                _jit.report_fault(Faults, _FAULT_SEQUSED, b, over)
            else:
                _jit.report_fault(Faults, _FAULT_CU_K, b, over)
            if split == 0:  # the slots the combine merges, in the plane after the last slot
                tl.store(LsePart + tl.cast(num_splits, tl.int64) * stride_lps + tok * stride_lpt + row_head,
                         tl.full([BLOCK_M], 0, tl.float32) + n_slots.to(tl.float32), mask=row_ok)
        else:
            n_slots = 1
            slot_step = 1
        for slot in range(split, n_slots, slot_step):
            if SPLIT_KV:  # one split a slot
                w_first = s0 + slot
                w_end = tl.minimum(w_first + 1, s_end)
            else:  # every split of the row, merged here
                w_first = s0
                w_end = s_end
            out = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            lse = tl.where(slot == 0, sink_lse, NEG_INF)
            for c in range(w_first, w_end):
                m_c = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
                l_c = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc_c = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                c_lo = tl.maximum(lo, split_start(c, SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS))
                c_hi = tl.minimum(hi, split_start(c + 1, SPLIT_N, HEAD_N, HEAD_KEYS, MID_N, MID_KEYS))
                acc_c, l_c, m_c, page_bad = attend_range(
                    acc_c, l_c, m_c, page_bad, q, k_src, v_src, c_lo, c_hi,
                    b, k_row0, seqlen_k, delta, q_pos, window_left, window_right, qk_scale, sm_scale, softcap,
                    BlockTable, stride_tb, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d,
                    d_ok, True, EVEN_D, PAGED, PAGE_SIZE, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_N,
                    DOT_PRECISION, USE_TMA, FP8_CVT, True,
                )
                o_c, lse_c = _jit.finalize(m_c, l_c, acc_c)
                if HAS_V_DESCALE:
                    o_c = o_c * v_descale
                out, lse = _jit.merge_state(out, lse, o_c, lse_c)
            if SPLIT_KV:
                s_ok = k_ok & scales_ok & fits
                if PAGED:
                    s_ok = s_ok & (any_bad_page(page_bad, PAGE_SIZE, BLOCK_N) == 0)
                slot64 = tl.cast(slot, tl.int64)
                p_rows = slot64 * stride_ps + tok * stride_pt + row_head * stride_ph
                tl.store(OutPart + p_rows[:, None] + offs_d[None, :], tl.where(s_ok, out, float("nan")),
                         mask=row_ok[:, None] & d_ok[None, :])
                tl.store(LsePart + slot64 * stride_lps + tok * stride_lpt + row_head,
                         tl.where(s_ok, lse, float("nan")), mask=row_ok)
    else:
        acc, l_i, m_i, page_bad = attend_range(
            acc, l_i, m_i, page_bad, q, k_src, v_src, tl.maximum(lo, s_lo), tl.minimum(full_lo, s_hi),
            b, k_row0, seqlen_k, delta, q_pos, window_left, window_right, qk_scale, sm_scale, softcap,
            BlockTable, stride_tb, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d, d_ok,
            True, EVEN_D, PAGED, PAGE_SIZE, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_N, DOT_PRECISION, USE_TMA, FP8_CVT,
        )
        acc, l_i, m_i, page_bad = attend_range(
            acc, l_i, m_i, page_bad, q, k_src, v_src, tl.maximum(full_lo, s_lo), tl.minimum(full_hi, s_hi),
            b, k_row0, seqlen_k, delta, q_pos, window_left, window_right, qk_scale, sm_scale, softcap,
            BlockTable, stride_tb, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d, d_ok,
            False, EVEN_D, PAGED, PAGE_SIZE, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_N, DOT_PRECISION, USE_TMA, FP8_CVT,
        )
        acc, l_i, m_i, page_bad = attend_range(
            acc, l_i, m_i, page_bad, q, k_src, v_src, tl.maximum(full_hi, s_lo), tl.minimum(hi, s_hi),
            b, k_row0, seqlen_k, delta, q_pos, window_left, window_right, qk_scale, sm_scale, softcap,
            BlockTable, stride_tb, num_blocks, stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d, d_ok,
            True, EVEN_D, PAGED, PAGE_SIZE, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, BLOCK_N, DOT_PRECISION, USE_TMA, FP8_CVT,
        )
        if HAS_SINKS:  # per row's query head (rows of a packed tile belong to different heads)
            sink = tl.load(Sinks + row_head * stride_sink) * LOG2E
            if SPLIT_KV:
                sink = tl.where(split == 0, sink, NEG_INF)
            m_i, l_i, acc = _jit.add_sink(m_i, l_i, acc, sink)
        out, lse = _jit.finalize(m_i, l_i, acc)
        if HAS_V_DESCALE:  # the output is linear in V: descale it once, not every value
            out = out * v_descale
    valid = k_ok & scales_ok
    if PAGED:
        page_bad = any_bad_page(page_bad, PAGE_SIZE, BLOCK_N)
        _jit.report_fault(Faults, _FAULT_PAGES, b, page_bad)
        valid = valid & (page_bad == 0)
    out = tl.where(valid, out, float("nan"))  # a split's NaN partial makes the combined row NaN
    lse = tl.where(valid, lse, float("nan"))

    # --- write the tile: final output, or this split's partial state
    out_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT_KV:
        o_rows = b.to(tl.int64) * stride_ob + (q_start + q_pos).to(tl.int64) * stride_ot + row_head * stride_oh
        tl.store(Out + o_rows[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=out_mask)
        if WRITE_LSE:
            l_rows = b.to(tl.int64) * stride_lb + row_head * stride_lh + (q_start + q_pos).to(tl.int64) * stride_lt
            tl.store(Lse + l_rows, lse, mask=row_ok)
    elif not INVARIANT:  # (the mode's split programs wrote their slots above)
        tok = (tok_base + q_pos).to(tl.int64)
        p_rows = split * stride_ps + tok * stride_pt + row_head * stride_ph
        tl.store(OutPart + p_rows[:, None] + offs_d[None, :], out, mask=out_mask)
        tl.store(LsePart + split * stride_lps + tok * stride_lpt + row_head, lse, mask=row_ok)


_PLANS = PlanCache(maxsize=4096)  # plans by signature (plan_key); a serving loop repeats a few


def clear_plans() -> None:
    """Forget every launch plan (after changing the launch table's module constants at run time)."""
    _PLANS.clear()


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    batch: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sm_scale: float,
    window: tuple[int, int],
    softcap: float,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    min_seqused_k: int = 0,
    batch_invariant: bool = False,
    signature: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the attention kernel on validated inputs (public functions validate first).

    q is ``[B, Sq, Hq, D]`` (dense) or ``[total_q, Hq, D]`` (with ``cu_seqlens_q``); k/v are
    ``[B, Sk, Hkv, D]``, ``[total_k, Hkv, D]`` (with ``cu_seqlens_k``) or pages
    ``[num_blocks, page_size, Hkv, D]`` (with ``block_table``). ``min_seqused_k``: the least valid
    entry of ``seqused_k`` (the keys appended just before). Returns ``(out, lse)``; out has q's
    shape and dtype (written into ``out`` when given: checked by the public functions, not here),
    lse is ``[B, Hq, Sq]`` or ``[Hq, total_q]`` fp32 (None unless ``return_lse``). ``sinks``: fp32
    ``[Hq]`` attention-sink logits, or None. ``k_descale``/``v_descale``: fp32 ``[Hkv]`` or one value
    (``[]``/``[1]``) by which stored K/V are multiplied (fp8 caches), or None. ``batch_invariant``:
    each row computed the same way whatever the call (:mod:`pagedflash.batch_invariance`).
    ``signature``: the plan key, where a public function has one from its own checks
    (:func:`~pagedflash.ops.attention_plan.public_plan_key`); None: :func:`plan_key` of the arguments.

    Metadata values are checked by the kernel, not here (nothing is read from the device): a
    sequence whose ``cu_seqlens``, ``seqused_k`` or page ids are invalid reads and writes nothing
    outside the tensors, gets NaN rows (and LSE), and is recorded in
    :func:`pagedflash.validate.fault_buffer` (invalid ``cu_seqlens_q``: every row NaN, since rows
    cannot be told apart).

    The launch plan (tiles, split count, grid, the kernel's integer arguments) is computed once per
    signature (:mod:`pagedflash.ops.attention_plan`) and reused, as are the split partials
    (:mod:`pagedflash.ops.scratch`); repeated launches skip Triton's argument binding where
    :mod:`pagedflash.ops.fastlaunch` can (:mod:`pagedflash.ops.attention_launch`).
    """
    if out is None:
        out = new_output(q)
    lse = _new_lse(q, cu_seqlens_q is not None) if return_lse else None
    left, right = window
    window = (left, right)
    sm_scale, softcap = float(sm_scale), float(softcap)
    key = signature
    if key is None:
        key = plan_key(q, k, v, out, lse, q.device, batch, max_seqlen_q, max_seqlen_k, window, softcap, cu_seqlens_q,
                       cu_seqlens_k, seqused_k, block_table, num_splits, config, sinks, k_descale, v_descale,
                       batch_invariant)
    plan = _PLANS.get(key)
    if plan is None:
        plan = make_plan(q, k, v, out, lse, batch=batch, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         window=window, softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         seqused_k=seqused_k, block_table=block_table, num_splits=num_splits, config=config,
                         sinks=sinks, k_descale=k_descale, v_descale=v_descale, invariant=batch_invariant)
        _PLANS.add(key, plan)
    _run(plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, sm_scale, softcap, left, right,
         sinks, k_descale, v_descale, max_seqlen_q, min_seqused_k, batch_invariant)
    return out, lse


def kept_forward(signature: tuple, q, k, v, out, return_lse: bool, seqused_k, block_table, sm_scale: float,
                 softcap: float, left: int, right: int, sinks, k_descale, v_descale, batch_invariant: bool,
                 varlen: tuple | None = None):
    """:func:`attention_forward` of a call (nothing appended, a fresh ``out``) whose plan is kept
    under its public ``signature`` (:func:`~pagedflash.ops.attention_plan.public_plan_key`), with
    positional arguments and the scalars already normalized (``sm_scale`` and ``softcap`` floats):
    ``(out, lse)``, or None where no plan is kept under ``signature`` (nothing launched: call
    :func:`attention_forward`). ``varlen``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q)`` of a
    packed-q call; None for dense q."""
    plan = _PLANS.get(signature)
    if plan is None:
        return None
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q = varlen or (None, None, q.shape[1])
    lse = _new_lse(q, varlen is not None) if return_lse else None
    _run(plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, sm_scale, softcap, left, right,
         sinks, k_descale, v_descale, max_seqlen_q, 0, batch_invariant)
    return out, lse


def _new_lse(q: torch.Tensor, varlen: bool) -> torch.Tensor:
    """The LSE of q's rows, fp32: ``[Hq, total_q]`` for packed q, else ``[B, Hq, Sq]``."""
    shape = q.shape
    return torch.empty((shape[1], shape[0]) if varlen else (shape[0], shape[2], shape[1]), dtype=torch.float32,
                       device=q.device)


def _run(plan: Plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, sm_scale, softcap, left,
         right, sinks, k_descale, v_descale, max_seqlen_q, min_seqused_k, batch_invariant) -> None:
    """Launch ``plan`` (the attention kernel, then the combine of its splits) on these tensors."""
    if plan.grid is None:  # no query rows
        return
    device = q.device
    split = plan.part_shapes is not None
    if split:
        out_part, lse_part = scratch.buffers(plan.part_shapes, device)
    else:
        out_part = lse_part = None  # unused
    k_shape = k.shape
    if block_table is not None:  # the kernel's bounds for metadata values
        kv_limit, num_blocks = min(block_table.shape[1] * k_shape[1], INT32_MAX), k_shape[0]
    else:
        kv_limit, num_blocks = k_shape[0] if cu_seqlens_k is not None else k_shape[1], 0
    # None: an absent optional tensor (its constexpr is off, never read): a null pointer to the fast
    # handle, which then reads no tensor's address for it; ``out`` on the public launch
    args = (q, k, v, out, lse, out_part, lse_part, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
            *plan.ints, sm_scale, softcap, left, right, sinks, k_descale, v_descale, *plan.head_strides,
            validate.fault_buffer(device), q.shape[0] if cu_seqlens_q is not None else 0, max_seqlen_q, kv_limit,
            min_seqused_k, num_blocks)
    attention_launch.launch(plan, args, _attention_kernel)
    if split:
        if plan.combine is None:
            plan.combine = combine.plan_combine(out_part, lse_part, out, lse, tokens_per_batch=plan.tokens_per_batch,
                                                invariant=batch_invariant, loads=launch.INVARIANT_COMBINE_LOADS)
        combine.launch_combine(plan.combine, out_part, lse_part, out, lse)

"""The expert GEMMs of the fused mixture-of-experts layer (:mod:`pagedflash.ops.moe`, which holds
the launch choices, the host side and the layout this module's kernels read; dimensions as there).

- ``_gate_up_kernel``: a block of ``BM`` pairs of one expert times its gate and up rows, biases and
  activation fused, into the intermediate ``[P, I]`` in the input dtype;
- ``_down_kernel``: a block of the intermediate times ``W2^T`` (plus bias) times each pair's routing
  weight, into per-pair partials ``[P, H]`` (fp32, or the input dtype), summed by ``_sum_k_kernel``;
- ``_down_sum_kernel`` (the *fused sum*, for few tokens): one program per (token, column block)
  runs the token's ``k`` experts' products in order ``j = 0..k-1`` (the per-expert epilogue
  :func:`_weighted` shared with ``_down_kernel``; with ``WIDE``, each expert's row scaled by its
  routing weight first, one accumulator for all ``k``) and stores their sum in the output dtype: no
  partials, no third launch.

Every sum runs in a fixed order: no atomics, results reproducible.
"""

import triton
import triton.language as tl

from pagedflash.ops._jit import (
    dot_over_k,
    launch_dependents,
    mac,
    mac_total,
    mac_zeros,
    prefetch_l2,
    report_fault,
    wait_for_primary,
)


@triton.jit
def _block(pid, BlockExpert, Ids, stride_id0, stride_id1, num_m, num_n, top_k, SORTED: tl.constexpr,
           GROUP_M: tl.constexpr):
    """Program ``pid`` -> ``(pid_n, pid_m, e)``: its column block, its row block and that block's
    expert (sorted: ``-1`` past the end, ``E`` for invalid ids; direct: the raw id). Programs are
    ordered in groups of ``GROUP_M`` row blocks sharing column blocks (L2 reuse)."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    if SORTED:
        e = tl.load(BlockExpert + pid_m).to(tl.int64)
    else:
        e = tl.load(Ids + (pid_m // top_k) * stride_id0 + (pid_m % top_k) * stride_id1).to(tl.int64)
    return pid_n, pid_m, e


@triton.jit
def _rows(SortedIds, start, pid_m, P, SORTED: tl.constexpr, BM: tl.constexpr):
    """A block's ``BM`` pair ids (``P``: a pad slot): sorted, the slots from ``start``; direct,
    pair ``pid_m`` alone."""
    offs = tl.arange(0, BM)
    if SORTED:
        return tl.load(SortedIds + start + offs)
    else:
        return tl.where(offs == 0, pid_m, P)


@triton.jit
def _gate_up_block(X, W13, B13, Inter, rows, e, pid_n, P, H, I, top_k, stride_x, stride_we, stride_wn, stride_be,
                   alpha, limit, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   USE_DOT: tl.constexpr, NUM_STAGES: tl.constexpr, WIDE: tl.constexpr):
    """:func:`_gate_up_kernel`'s product for one block of ``BM`` pairs ``rows`` of (valid) expert ``e``."""
    row_ok = rows < P
    tok = tl.where(row_ok, rows // top_k, 0).to(tl.int64)  # pad rows read row 0, never stored
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < I
    w_n = offs_n % I  # in-bounds rows for every column; the store masks the extra ones
    offs_k = tl.arange(0, BK)
    p_x = X + tok[:, None] * stride_x + offs_k[None, :]
    p_g = W13 + e * stride_we + w_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    p_u = p_g + I * stride_wn
    acc_g = mac_zeros(BM, BN, BK, WIDE)
    acc_u = mac_zeros(BM, BN, BK, WIDE)
    for k0 in tl.range(0, H, BK, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(p_x)
            wg = tl.load(p_g)
            wu = tl.load(p_u)
        else:
            k_ok = offs_k < H - k0
            x = tl.load(p_x, mask=k_ok[None, :], other=0.0)
            wg = tl.load(p_g, mask=k_ok[:, None], other=0.0)
            wu = tl.load(p_u, mask=k_ok[:, None], other=0.0)
        acc_g = mac(x, wg, acc_g, DOT_PRECISION, USE_DOT, WIDE)
        acc_u = mac(x, wu, acc_u, DOT_PRECISION, USE_DOT, WIDE)
        p_x += BK
        p_g += BK
        p_u += BK
    acc_g = mac_total(acc_g, WIDE)
    acc_u = mac_total(acc_u, WIDE)
    if HAS_BIAS:
        p_b = B13 + e * stride_be + w_n
        acc_g += tl.load(p_b).to(tl.float32)[None, :]
        acc_u += tl.load(p_b + I).to(tl.float32)[None, :]
    if ACT == 0:  # silu(g) * u
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:  # GPT-OSS: g clamped above, u both sides (NaN kept), (u + 1) * g * sigmoid(alpha * g)
        g = tl.where(acc_g > limit, limit, acc_g)
        u = tl.where(acc_u > limit, limit, tl.where(acc_u < -limit, -limit, acc_u))
        h = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
    p_i = Inter + rows.to(tl.int64)[:, None] * I + offs_n[None, :]
    tl.store(p_i, h.to(Inter.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["alpha", "limit"])
def _gate_up_kernel(
    X,  # [T, H] hidden, row stride stride_x
    W13,  # [E, 2I, H]: gate rows 0..I-1, up rows I..2I-1
    B13,  # [E, 2I] (HAS_BIAS)
    SortedIds,  # [NB * BM] pair ids grouped by expert (SORTED)
    BlockExpert, BlockStart, BlockSlots,  # [NB] each row block's expert, first slot and slots (SORTED)
    Ids,  # [T, k] expert ids (direct)
    Inter,  # [P, I] act(gate, up), row stride I
    P, H, I, E, top_k, num_m,
    stride_x, stride_we, stride_wn, stride_be, stride_id0, stride_id1,
    alpha, limit,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SORTED: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    USE_DOT: tl.constexpr, NUM_STAGES: tl.constexpr,
    WIDE: tl.constexpr,  # CUDA-core products into [BK, BN] accumulators, reduced along K after the loop
    PDL: tl.constexpr,  # the down kernel is this one's programmatic dependent: let it launch at once
    HALF: tl.constexpr,  # half tails (SORTED): a block of BM // 2 slots runs a tile of BM // 2 rows
):
    if PDL:
        launch_dependents()
    num_n = tl.cdiv(I, BN)
    pid_n, pid_m, e = _block(tl.program_id(0), BlockExpert, Ids, stride_id0, stride_id1, num_m, num_n, top_k,
                             SORTED, GROUP_M)
    if (e < 0) | (e >= E):  # past the end, or an invalid id (the down kernel writes its NaN)
        return
    if HALF:
        start = tl.load(BlockStart + pid_m)
        if tl.load(BlockSlots + pid_m) < BM:  # a half tail
            _gate_up_block(X, W13, B13, Inter, _rows(SortedIds, start, pid_m, P, SORTED, BM // 2), e, pid_n, P, H,
                           I, top_k, stride_x, stride_we, stride_wn, stride_be, alpha, limit, ACT, HAS_BIAS, EVEN_K,
                           DOT_PRECISION, BM // 2, BN, BK, USE_DOT, NUM_STAGES, WIDE)
        else:
            _gate_up_block(X, W13, B13, Inter, _rows(SortedIds, start, pid_m, P, SORTED, BM), e, pid_n, P, H, I,
                           top_k, stride_x, stride_we, stride_wn, stride_be, alpha, limit, ACT, HAS_BIAS, EVEN_K,
                           DOT_PRECISION, BM, BN, BK, USE_DOT, NUM_STAGES, WIDE)
    else:
        _gate_up_block(X, W13, B13, Inter, _rows(SortedIds, pid_m * BM, pid_m, P, SORTED, BM), e, pid_n, P, H, I,
                       top_k, stride_x, stride_we, stride_wn, stride_be, alpha, limit, ACT, HAS_BIAS, EVEN_K,
                       DOT_PRECISION, BM, BN, BK, USE_DOT, NUM_STAGES, WIDE)


@triton.jit
def _weighted(acc, B2, TopkW, e, pairs, w_n, top_k, stride_be, stride_tw0, stride_tw1, HAS_BIAS: tl.constexpr):
    """An expert's down product ``acc`` ``[BM, BN]`` plus its bias (columns ``w_n`` of expert ``e``)
    times each pair's routing weight (``pairs``: ``[BM]`` in-bounds pair ids), fp32."""
    if HAS_BIAS:
        acc += tl.load(B2 + e * stride_be + w_n).to(tl.float32)[None, :]
    weight = tl.load(TopkW + (pairs // top_k) * stride_tw0 + (pairs % top_k) * stride_tw1)
    return acc * weight.to(tl.float32)[:, None]


@triton.jit
def _expert_down(Inter, W2, B2, TopkW, rows, row_ok, e, offs_n, H, I, top_k,
                 stride_we, stride_wn, stride_be, stride_tw0, stride_tw1,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One expert's weighted output for a block of pairs: intermediate rows ``rows`` (``row_ok``
    False: a pad row, which reads row 0) times expert ``e``'s (valid) ``W2^T`` columns ``offs_n``,
    then :func:`_weighted`: ``[BM, BN]`` fp32."""
    safe_rows = tl.where(row_ok, rows, 0).to(tl.int64)
    w_n = offs_n % H  # in-bounds rows for every column; the caller's store masks the extra ones
    offs_k = tl.arange(0, BK)
    p_a = Inter + safe_rows[:, None] * I + offs_k[None, :]
    p_w = W2 + e * stride_we + w_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc = dot_over_k(acc, p_a, p_w, I, BK, EVEN_K, DOT_PRECISION, NUM_STAGES)
    return _weighted(acc, B2, TopkW, e, safe_rows, w_n, top_k, stride_be, stride_tw0, stride_tw1, HAS_BIAS)


@triton.jit
def _down_block(Inter, W2, B2, TopkW, Part, Faults, rows, e, pid_n, P, H, I, E, top_k,
                stride_we, stride_wn, stride_be, stride_tw0, stride_tw1,
                HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, FAULT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """:func:`_down_kernel`'s partials for one block of ``BM`` pairs ``rows`` of expert ``e``."""
    row_ok = rows < P
    offs_n = pid_n * BN + tl.arange(0, BN)
    p_out = Part + rows.to(tl.int64)[:, None] * H + offs_n[None, :]
    out_mask = row_ok[:, None] & (offs_n < H)[None, :]
    if (e < 0) | (e >= E):  # an invalid expert id: no weight read, the pair's contribution is NaN
        tl.store(p_out, tl.full([BM, BN], float("nan"), tl.float32).to(Part.dtype.element_ty), mask=out_mask)
        if pid_n == 0:
            report_fault(Faults, FAULT, rows // top_k, row_ok)  # the token
    else:
        acc = _expert_down(Inter, W2, B2, TopkW, rows, row_ok, e, offs_n, H, I, top_k,
                           stride_we, stride_wn, stride_be, stride_tw0, stride_tw1,
                           HAS_BIAS, EVEN_K, DOT_PRECISION, BM, BN, BK, NUM_STAGES)
        tl.store(p_out, acc.to(Part.dtype.element_ty), mask=out_mask)


@triton.jit
def _down_kernel(
    Inter,  # [P, I] from _gate_up_kernel
    W2,  # [E, H, I]
    B2,  # [E, H] (HAS_BIAS)
    TopkW,  # [T, k] fp32 routing weights
    SortedIds, BlockExpert, BlockStart, BlockSlots, Ids,  # as in _gate_up_kernel
    Part,  # [P, H] fp32 or the input dtype: each pair's weighted expert output
    Faults,  # int32 [NUM_FAULTS]: pagedflash.validate's fault buffer (FAULT: the code)
    P, H, I, E, top_k, num_m,
    stride_we, stride_wn, stride_be, stride_tw0, stride_tw1, stride_id0, stride_id1,
    HAS_BIAS: tl.constexpr, SORTED: tl.constexpr, EVEN_K: tl.constexpr, FAULT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, HALF: tl.constexpr,
):
    num_n = tl.cdiv(H, BN)
    pid_n, pid_m, e = _block(tl.program_id(0), BlockExpert, Ids, stride_id0, stride_id1, num_m, num_n, top_k,
                             SORTED, GROUP_M)
    if SORTED:
        if e < 0:  # past the end of the grouped rows
            return
    if HALF:
        start = tl.load(BlockStart + pid_m)
        if tl.load(BlockSlots + pid_m) < BM:  # a half tail
            _down_block(Inter, W2, B2, TopkW, Part, Faults, _rows(SortedIds, start, pid_m, P, SORTED, BM // 2), e,
                        pid_n, P, H, I, E, top_k, stride_we, stride_wn, stride_be, stride_tw0, stride_tw1, HAS_BIAS,
                        EVEN_K, FAULT, DOT_PRECISION, BM // 2, BN, BK, NUM_STAGES)
        else:
            _down_block(Inter, W2, B2, TopkW, Part, Faults, _rows(SortedIds, start, pid_m, P, SORTED, BM), e, pid_n,
                        P, H, I, E, top_k, stride_we, stride_wn, stride_be, stride_tw0, stride_tw1, HAS_BIAS, EVEN_K,
                        FAULT, DOT_PRECISION, BM, BN, BK, NUM_STAGES)
    else:
        _down_block(Inter, W2, B2, TopkW, Part, Faults, _rows(SortedIds, pid_m * BM, pid_m, P, SORTED, BM), e, pid_n,
                    P, H, I, E, top_k, stride_we, stride_wn, stride_be, stride_tw0, stride_tw1, HAS_BIAS, EVEN_K,
                    FAULT, DOT_PRECISION, BM, BN, BK, NUM_STAGES)


@triton.jit
def _down_sum_kernel(
    Inter, W2, B2, TopkW,  # as in _down_kernel
    Ids,  # [T, k] expert ids
    Out,  # [T, H], row stride stride_o
    Faults,  # as in _down_kernel
    T, H, I, E, top_k,
    stride_o, stride_we, stride_wn, stride_be, stride_tw0, stride_tw1, stride_id0, stride_id1,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, FAULT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,  # next_pow2(top_k)
    WIDE: tl.constexpr,  # one row on the CUDA cores: every expert's products, the row already times its
    # routing weight, into one [BK, BN] accumulator, reduced along K once after the loop
    PDL: tl.constexpr,  # launched as gate/up's programmatic dependent: 1 waits for it before reading the
    # intermediate; 2 first asks for its weight rows of the first PF_K experts in L2 (PF_LINES lines a row)
    PF_K: tl.constexpr, PF_LINES: tl.constexpr,
):
    """Program ``pid``: token ``pid % T`` (the tokens of one column block run together: experts they
    share are read once from HBM), column block ``pid // T``. Row 0 of the ``BM``-row tile is the
    token's pair, the other rows are masked (the smallest ``tl.dot``; ``BM`` 1 with ``USE_DOT``
    False: a matrix-vector product). One loop over (expert ``j``, K step), so that the pipeline runs
    on from one expert into the next; at expert ``j``'s last step its product goes through
    :func:`_weighted` into the sum, in order ``j = 0..k-1``: the operations of ``_down_kernel`` then
    ``_sum_k_kernel`` in the same order (bitwise equal under the interpreter; compiled, the weight's
    multiply and the sum's add may become one fma). ``WIDE`` sums in another order: each expert's
    row times its routing weight first, all ``k`` products in one accumulator, biases (times their
    weights) added after the loop."""
    pid = tl.program_id(0)
    t = pid % T
    offs_n = (pid // T) * BN + tl.arange(0, BN)
    w_n = offs_n % H  # in-bounds rows for every column; the store masks the extra ones
    first = tl.arange(0, BM) == 0
    offs_k = tl.arange(0, BK)
    # the token's expert ids, in registers: the loop's weight addresses then depend on no load in
    # the loop, which lets the compiler pipeline it (an id loaded per step kept it to one stage)
    slots = tl.arange(0, BLOCK_TOPK)
    expert_ids = tl.load(Ids + t * stride_id0 + slots * stride_id1, mask=slots < top_k, other=0)
    bad = (expert_ids < 0) | (expert_ids >= E)
    report_fault(Faults, FAULT, t + slots * 0, bad & (slots < tl.where(pid < T, top_k, 0)))  # column block 0
    if PDL == 2:  # while gate/up still runs: this program's rows of W2, a pointer per 128-byte line
        step = 128 // (W2.dtype.element_ty.primitive_bitwidth // 8)
        cols = tl.minimum(tl.arange(0, PF_LINES) * step, I - 1)
        for slot in tl.static_range(PF_K):
            if slot < top_k:
                pf_e = tl.sum(tl.where(slots == slot, expert_ids, 0)).to(tl.int64)
                pf_e = tl.where((pf_e >= 0) & (pf_e < E), pf_e, 0)
                prefetch_l2(W2 + pf_e * stride_we + w_n.to(tl.int64)[:, None] * stride_wn + cols[None, :])
    if PDL:
        wait_for_primary()  # gate/up's intermediate complete and visible
    steps = tl.cdiv(I, BK)
    acc = mac_zeros(BM, BN, BK, WIDE)
    total = tl.zeros([BM, BN], dtype=tl.float32)
    for s in tl.range(0, top_k * steps, num_stages=NUM_STAGES):
        j = s // steps
        k0 = (s - j * steps) * BK
        e = tl.sum(tl.where(slots == j, expert_ids, 0)).to(tl.int64)
        ok = (e >= 0) & (e < E)  # an invalid id reads no weight; its pair's contribution is NaN
        e = tl.where(ok, e, 0)
        pair = (t * top_k + j).to(tl.int64)
        p_a = Inter + pair * I + k0 + offs_k[None, :] + tl.zeros([BM, 1], dtype=tl.int64)  # [BM, BK]
        p_w = W2 + e * stride_we + w_n.to(tl.int64)[None, :] * stride_wn + (k0 + offs_k)[:, None]  # [BK, BN]
        if EVEN_K:
            k_ok = offs_k < tl.where(ok, BK, 0)
        else:
            k_ok = offs_k < tl.where(ok, I - k0, 0)
        a = tl.load(p_a, mask=first[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(p_w, mask=k_ok[:, None], other=0.0)
        if WIDE:  # BM is 1: the row is the pair's; an invalid id's weight is NaN
            weight = tl.load(TopkW + t * stride_tw0 + j * stride_tw1)
            acc = mac(a.to(tl.float32) * tl.where(ok, weight, float("nan")), w, acc, DOT_PRECISION, USE_DOT, WIDE)
        else:
            acc = mac(a, w, acc, DOT_PRECISION, USE_DOT)
            last = k0 + BK >= I
            done = _weighted(acc, B2, TopkW, e, pair + tl.zeros([BM], dtype=tl.int64), w_n, top_k, stride_be,
                             stride_tw0, stride_tw1, HAS_BIAS)
            total = tl.where(last, total + tl.where(ok, done, float("nan")), total)
            acc = tl.where(last, 0.0, acc)
    if WIDE:
        total = mac_total(acc, WIDE)
        if HAS_BIAS:
            for j in range(0, top_k):
                e = tl.sum(tl.where(slots == j, expert_ids, 0)).to(tl.int64)
                weight = tl.load(TopkW + t * stride_tw0 + j * stride_tw1)
                e = tl.where((e >= 0) & (e < E), e, 0)  # an invalid id's NaN is in the products already
                total += (tl.load(B2 + e * stride_be + w_n).to(tl.float32) * weight)[None, :]
    p_out = Out + t.to(tl.int64) * stride_o + offs_n[None, :] + tl.zeros([BM, 1], dtype=tl.int64)
    tl.store(p_out, total.to(Out.dtype.element_ty), mask=first[:, None] & (offs_n < H)[None, :])


@triton.jit
def _sum_k_kernel(
    Part,  # [T, k, H] fp32 or the input dtype
    Out,  # [T, H], row stride stride_o
    H, top_k, stride_o,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(top_k):  # fixed order: reproducible
        acc += tl.load(Part + (t * top_k + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_o + cols, acc.to(Out.dtype.element_ty), mask=ok)

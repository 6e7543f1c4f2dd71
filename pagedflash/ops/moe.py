"""Fused mixture-of-experts layer: routing, token grouping by expert, and the expert MLP as two
grouped GEMMs (issue 33). Dimensions: ``T`` tokens, ``H`` hidden size, ``E`` experts, ``I`` an
expert's intermediate size, ``k`` = ``top_k`` experts per token, ``P = T * k`` (token, slot) pairs.

- :func:`route`: router logits ``[T, E]`` -> ``(weights fp32 [T, k], ids int32 [T, k])``, torch ops
  on the device (softmax/top-k: ``torch.topk`` needs no host sync and is CUDA-graph safe, and a
  Triton kernel would save at most one small launch).
- :func:`fused_moe`: ``sum_j w[t, j] * expert_{ids[t, j]}(x_t)`` in three kernels:

  1. ``_gate_up_kernel``: for a block of ``BM`` pairs routed to one expert, ``x W_gate^T`` and
     ``x W_up^T`` (two accumulators over the same rows of ``x``), the biases and the activation
     fused; writes the intermediate ``[P, I]`` in the input dtype.
  2. ``_down_kernel``: the intermediate times ``W2^T`` (plus bias) times the pair's routing weight,
     written per pair into ``[P, H] = [T, k, H]`` fp32: no atomics, so results are reproducible.
  3. ``_sum_k_kernel``: each token's ``k`` rows summed in fixed order in fp32, stored in ``out``.

Grouping (which pairs a block of rows holds) has two forms, chosen on the host from the shapes
(:func:`tiles`), never from device values:

- *direct* (few pairs, decode): block ``m`` is pair ``m`` alone; its expert id is read by the kernel.
  No grouping launch at all; an expert picked by two pairs is read twice (from L2 when the programs
  run together). ``T = 1`` always has distinct experts.
- *sorted*: pairs grouped by expert (:func:`_group`: three small kernels), each expert's run
  padded to a multiple of ``BM``; block ``m`` holds ``BM`` slots of one expert (pad slots hold the
  sentinel ``P``). The padded length is bounded on the host by ``P + min(E + 1, P) * (BM - 1)``; blocks
  past the device's true end have expert ``-1`` and their programs return at once, so empty experts
  cost one early exit per program slot.

Invalid expert ids (outside ``[0, E)``, possible only with value checks off: the debug mode
:func:`pagedflash.validate.value_checks` refuses them on the host) read no weight: their pair's
contribution is NaN, so the token's output row is NaN, and the token is recorded in the fault
buffer (``validate.FAULT_TOPK_IDS``: :func:`pagedflash.validate.raise_if_invalid` names it). Pad rows of a block read ``x``'s row 0 (or the
intermediate's) and are never stored; every ragged edge along ``H`` and ``I`` is masked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import custom_ops
from pagedflash.ops._jit import report_fault
from pagedflash.ops.utils import Launch, PlanCache, cdiv, check_operand, next_pow2

SCORINGS = ("softmax", "topk_softmax")
ACTIVATIONS = {"silu": 0, "swigluoai": 1}  # name -> the kernels' ACT constexpr
SILU, SWIGLUOAI = 0, 1
_IDS_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------- kernels


@triton.jit
def _block(pid, SortedIds, BlockExpert, Ids, stride_id0, stride_id1, num_m, num_n, P, top_k,
           SORTED: tl.constexpr, BM: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid`` -> ``(pid_n, e, rows)``: its column block, its block's expert (sorted: ``-1``
    past the end, ``E`` for invalid ids; direct: the raw id) and its ``BM`` pair ids (``P`` = pad).
    Programs are ordered in groups of ``GROUP_M`` row blocks sharing column blocks (L2 reuse)."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs = tl.arange(0, BM)
    if SORTED:
        e = tl.load(BlockExpert + pid_m).to(tl.int64)
        rows = tl.load(SortedIds + pid_m * BM + offs)
    else:
        e = tl.load(Ids + (pid_m // top_k) * stride_id0 + (pid_m % top_k) * stride_id1).to(tl.int64)
        rows = tl.where(offs == 0, pid_m, P)
    return pid_n, e, rows


@triton.jit(do_not_specialize=["alpha", "limit"])
def _gate_up_kernel(
    X,  # [T, H] hidden, row stride stride_x
    W13,  # [E, 2I, H]: gate rows 0..I-1, up rows I..2I-1
    B13,  # [E, 2I] (HAS_BIAS)
    SortedIds,  # [NB * BM] pair ids grouped by expert (SORTED)
    BlockExpert,  # [NB] each row block's expert (SORTED)
    Ids,  # [T, k] expert ids (direct)
    Inter,  # [P, I] act(gate, up), row stride I
    P, H, I, E, top_k, num_m,
    stride_x, stride_we, stride_wn, stride_be, stride_id0, stride_id1,
    alpha, limit,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SORTED: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_n = tl.cdiv(I, BN)
    pid_n, e, rows = _block(tl.program_id(0), SortedIds, BlockExpert, Ids, stride_id0, stride_id1, num_m, num_n,
                            P, top_k, SORTED, BM, GROUP_M)
    if (e < 0) | (e >= E):  # past the end, or an invalid id (the down kernel writes its NaN)
        return
    row_ok = rows < P
    tok = tl.where(row_ok, rows // top_k, 0).to(tl.int64)  # pad rows read row 0, never stored
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < I
    w_n = offs_n % I  # in-bounds rows for every column; the store masks the extra ones
    offs_k = tl.arange(0, BK)
    p_x = X + tok[:, None] * stride_x + offs_k[None, :]
    p_g = W13 + e * stride_we + w_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    p_u = p_g + I * stride_wn
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        if EVEN_K:
            x = tl.load(p_x)
            wg = tl.load(p_g)
            wu = tl.load(p_u)
        else:
            k_ok = offs_k < H - k0
            x = tl.load(p_x, mask=k_ok[None, :], other=0.0)
            wg = tl.load(p_g, mask=k_ok[:, None], other=0.0)
            wu = tl.load(p_u, mask=k_ok[:, None], other=0.0)
        acc_g = tl.dot(x, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(x, wu, acc_u, input_precision=DOT_PRECISION)
        p_x += BK
        p_g += BK
        p_u += BK
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


@triton.jit
def _down_kernel(
    Inter,  # [P, I] from _gate_up_kernel
    W2,  # [E, H, I]
    B2,  # [E, H] (HAS_BIAS)
    TopkW,  # [T, k] fp32 routing weights
    SortedIds, BlockExpert, Ids,  # as in _gate_up_kernel
    Part,  # [P, H] fp32: each pair's weighted expert output
    Faults,  # int32 [NUM_FAULTS]: pagedflash.validate's fault buffer (FAULT: the code)
    P, H, I, E, top_k, num_m,
    stride_we, stride_wn, stride_be, stride_tw0, stride_tw1, stride_id0, stride_id1,
    HAS_BIAS: tl.constexpr, SORTED: tl.constexpr, EVEN_K: tl.constexpr, FAULT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_n = tl.cdiv(H, BN)
    pid_n, e, rows = _block(tl.program_id(0), SortedIds, BlockExpert, Ids, stride_id0, stride_id1, num_m, num_n,
                            P, top_k, SORTED, BM, GROUP_M)
    if SORTED:
        if e < 0:  # past the end of the grouped rows
            return
    row_ok = rows < P
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < H
    p_out = Part + rows.to(tl.int64)[:, None] * H + offs_n[None, :]
    out_mask = row_ok[:, None] & n_ok[None, :]
    if (e < 0) | (e >= E):  # an invalid expert id: no weight read, the pair's contribution is NaN
        tl.store(p_out, tl.full([BM, BN], float("nan"), tl.float32), mask=out_mask)
        if pid_n == 0:
            report_fault(Faults, FAULT, rows // top_k, row_ok)  # the token
        return
    safe_rows = tl.where(row_ok, rows, 0).to(tl.int64)
    w_n = offs_n % H
    offs_k = tl.arange(0, BK)
    p_a = Inter + safe_rows[:, None] * I + offs_k[None, :]
    p_w = W2 + e * stride_we + w_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        if EVEN_K:
            a = tl.load(p_a)
            w = tl.load(p_w)
        else:
            k_ok = offs_k < I - k0
            a = tl.load(p_a, mask=k_ok[None, :], other=0.0)
            w = tl.load(p_w, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        p_a += BK
        p_w += BK
    if HAS_BIAS:
        acc += tl.load(B2 + e * stride_be + w_n).to(tl.float32)[None, :]
    weight = tl.load(TopkW + (safe_rows // top_k) * stride_tw0 + (safe_rows % top_k) * stride_tw1)
    tl.store(p_out, acc * weight.to(tl.float32)[:, None], mask=out_mask)


@triton.jit
def _sum_k_kernel(
    Part,  # [T, k, H] fp32
    Out,  # [T, H], row stride stride_o
    H, top_k, stride_o,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(top_k):  # fixed order: reproducible
        acc += tl.load(Part + (t * top_k + j) * H + cols, mask=ok, other=0.0)
    tl.store(Out + t * stride_o + cols, acc.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _bucket(Ids, p, ok, E, top_k, stride_id0, stride_id1):
    """Pair ``p``'s run: its expert id, or ``E`` for an id outside ``[0, E)``."""
    e = tl.load(Ids + (p // top_k) * stride_id0 + (p % top_k) * stride_id1, mask=ok, other=0).to(tl.int64)
    return tl.where((e >= 0) & (e < E), e, E)


@triton.jit
def _count_kernel(
    Ids,  # [T, k] expert ids
    Counts,  # [BLOCK_E] int32, zeroed: pairs per run (E + 1 runs)
    P, E, top_k, stride_id0, stride_id1,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < P
    tl.atomic_add(Counts + _bucket(Ids, p, ok, E, top_k, stride_id0, stride_id1), 1, mask=ok)


@triton.jit
def _offsets_kernel(
    Counts,  # [BLOCK_E] int32 from _count_kernel
    Cursor,  # [BLOCK_E] int32: each run's first slot (for _scatter_kernel)
    SortedIds,  # [num_blocks * BM]: pad slots written here (P)
    BlockExpert,  # [num_blocks] int32: each block's run, -1 past the last
    P, E, num_blocks,
    BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """One program: runs padded to BM, each block's run, and the pad slots (disjoint from the slots
    _scatter_kernel fills, so the two need no ordering)."""
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(Counts + e)
    padded = (counts + (BM - 1)) // BM * BM
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(Cursor + e, starts)
    for b0 in range(0, num_blocks, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        blk_ok = blk < num_blocks
        s0 = blk * BM
        run = tl.sum((ends[None, :] <= s0[:, None]).to(tl.int32), 1)  # empty runs end where the next starts
        in_run = e[None, :] == run[:, None]
        start = tl.sum(tl.where(in_run, starts[None, :], 0), 1)
        count = tl.sum(tl.where(in_run, counts[None, :], 0), 1)
        tl.store(BlockExpert + blk, tl.where(run <= E, run, -1), mask=blk_ok)
        slot = s0[:, None] + tl.arange(0, BM)[None, :]
        pad = slot - start[:, None] >= count[:, None]
        tl.store(SortedIds + slot, tl.full([BLOCK_B, BM], 0, tl.int32) + P, mask=pad & blk_ok[:, None])


@triton.jit
def _scatter_kernel(
    Ids,  # [T, k] expert ids
    Cursor,  # [BLOCK_E] int32 from _offsets_kernel: the next free slot of each run
    SortedIds,  # [num_blocks * BM]: each pair's id in a slot of its run
    P, E, top_k, stride_id0, stride_id1,
    BLOCK: tl.constexpr,
):
    """Slots within a run are taken in any order (atomics): a pair's result does not depend on which
    row of its expert's blocks it occupies, so the layer's output is still reproducible."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < P
    slot = tl.atomic_add(Cursor + _bucket(Ids, p, ok, E, top_k, stride_id0, stride_id1), 1, mask=ok)
    tl.store(SortedIds + slot, p, mask=ok)


# ---------------------------------------------------------------- launch choices


class Tiles(NamedTuple):
    """One call's launch choices: grouping form, rows per block, the two GEMMs' column and
    reduction blocks, warps and pipeline stages."""

    direct: bool
    bm: int
    bn13: int  # columns of gate (and as many of up) per program
    bn2: int
    bk: int
    warps: int
    stages: int
    group_m: int


TILES: Tiles | None = None  # forced tiles (tests, tuning)
DECODE_MAX_TOKENS = 64  # up to here, or while experts average <= 16 rows, the decode tiles


def tiles(T: int, top_k: int, E: int) -> Tiles:
    """Launch choices from the host's shapes (no device value); ``rows = T * top_k / E`` is the
    average number of rows an expert gets:

    - direct grouping for one token (its experts are distinct) or while pairs are at most a quarter
      of the experts (few experts picked twice), else sorted;
    - decode (``T <= DECODE_MAX_TOKENS`` or ``rows <= 16``: weight-bandwidth bound): 16-row blocks
      (the smallest ``tl.dot``), 32-wide column blocks so that even one token spreads each expert's
      weight over many programs, 128-deep reduction steps, 4 stages to keep weight bytes in flight;
    - prefill: 64-row blocks (128 from 256 rows per expert), 64 gate + 64 up columns and 128 down
      columns, 64-deep steps, 3 stages, 8 warps on the 128-row tiles; programs grouped 8 row blocks
      at a time over the column blocks (L2 reuse of the rows).
    Unmeasured guesses on the H200: ``pagedflash bench moe`` is the measure, :data:`TILES` the override."""
    if TILES is not None:
        return TILES
    direct = T == 1 or T * top_k * 4 <= E
    rows = T * top_k / E
    if T <= DECODE_MAX_TOKENS or rows <= 16:
        return Tiles(direct, 16, 32, 32, 128, 4, 4, 1)
    bm = 128 if rows >= 256 else 64
    return Tiles(False, bm, 64, 128, 64, 8 if bm == 128 else 4, 3, 8)


# ---------------------------------------------------------------- host


def _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation: int, out) -> None:
    check_operand("hidden", hidden, (None, None))
    T, H = hidden.shape
    if H < 1:
        raise ValueError(f"hidden: expected at least one column (H), got shape {tuple(hidden.shape)}")
    check_operand("w13", w13, (None, None, H), like=("hidden", hidden))
    E, two_i = w13.shape[0], w13.shape[1]
    if E < 1 or two_i < 2 or two_i % 2:
        raise ValueError(f"w13: expected [E, 2I, H] with E >= 1 and an even 2I >= 2 (gate rows, then up), "
                         f"got shape {tuple(w13.shape)}")
    I = two_i // 2
    check_operand("w2", w2, (E, H, I), like=("hidden", hidden))
    check_operand("topk_weights", topk_weights, (T, None), dtypes=(torch.float32,))
    k = topk_weights.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"topk_weights: expected between 1 and E = {E} columns (top_k), got shape "
                         f"{tuple(topk_weights.shape)}")
    if topk_weights.device != hidden.device:
        raise ValueError(f"topk_weights: expected a tensor on {hidden.device} (where hidden is), "
                         f"got one on {topk_weights.device}")
    validate.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=_IDS_DTYPES, device=hidden.device)
    if tuple(topk_ids.shape) != (T, k):
        raise ValueError(f"topk_ids: expected shape {(T, k)} (topk_weights'), got {tuple(topk_ids.shape)}")
    if (w13_bias is None) != (w2_bias is None):
        raise ValueError("w13_bias, w2_bias: expected both or neither, got "
                         f"{'w13_bias' if w2_bias is None else 'w2_bias'} alone")
    if w13_bias is not None:
        if activation != SWIGLUOAI:
            raise ValueError("w13_bias: expert biases go with activation='swigluoai' (GPT-OSS), got activation='silu'")
        check_operand("w13_bias", w13_bias, (E, two_i), like=("hidden", hidden))
        check_operand("w2_bias", w2_bias, (E, H), like=("hidden", hidden))
    if out is not None:
        check_operand("out", out, (T, H), like=("hidden", hidden))
        validate.check_out_separate(out, dict(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights,
                                              topk_ids=topk_ids, w13_bias=w13_bias, w2_bias=w2_bias))
    validate.check_no_grad(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, w13_bias=w13_bias,
                           w2_bias=w2_bias)


class _Plan(NamedTuple):
    tiles: Tiles
    num_blocks: int  # row blocks: pairs (direct) or the padded bound / bm (sorted)
    block_e: int  # lanes of the grouping kernels' per-run vectors (E + 1 runs)
    count: Launch  # grouping (sorted): pairs per run
    offsets: Launch  # grouping: run starts, block experts, pad slots
    scatter: Launch  # grouping: pairs into their runs' slots
    gate_up: Launch
    down: Launch
    sum_k: Launch


def _plan(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation: int, out) -> _Plan:
    """Check the operands (all the checks read is in the plan's key) and work out the launches."""
    _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation, out)
    T, H = hidden.shape
    E, I, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    P = T * k
    t = tiles(T, k, E)
    num_blocks = P if t.direct else cdiv(P + min(E + 1, P) * (t.bm - 1), t.bm)  # runs: E, invalid ids
    consts = dict(HAS_BIAS=w13_bias is not None, SORTED=not t.direct,
                  DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", BM=t.bm, BK=t.bk,
                  GROUP_M=t.group_m)
    opts = dict(num_warps=t.warps, num_stages=t.stages)
    nothing = T == 0
    gate_up = Launch(_gate_up_kernel, None if nothing else (num_blocks * cdiv(I, t.bn13),),
                     dict(consts, ACT=activation, EVEN_K=H % t.bk == 0, BN=t.bn13), **opts)
    down = Launch(_down_kernel, None if nothing else (num_blocks * cdiv(H, t.bn2),),
                  dict(consts, EVEN_K=I % t.bk == 0, BN=t.bn2, FAULT=_fault_code()), **opts)
    block_h = min(1024, next_pow2(H))
    sum_k = Launch(_sum_k_kernel, None if nothing else (T, cdiv(H, block_h)), dict(BLOCK_H=block_h))
    group = nothing or t.direct
    block_p = min(1024, next_pow2(P))
    block_e = max(4, next_pow2(E + 1))
    count = Launch(_count_kernel, None if group else (cdiv(P, block_p),), dict(BLOCK=block_p))
    offsets = Launch(_offsets_kernel, None if group else (1,),
                     dict(BM=t.bm, BLOCK_E=block_e, BLOCK_B=max(1, min(32, 4096 // block_e))))
    scatter = Launch(_scatter_kernel, None if group else (cdiv(P, block_p),), dict(BLOCK=block_p))
    return _Plan(t, num_blocks, block_e, count, offsets, scatter, gate_up, down, sum_k)


_PLANS = PlanCache()


def _launch(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation: int, alpha: float,
            limit: float, out) -> None:
    key = _PLANS.key(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, out,
                     extra=(activation, TILES, _fault_code()))
    plan = _PLANS.get(key) or _PLANS.add(key, _plan(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias,
                                                    activation, out))
    if validate.value_checks_enabled(topk_ids):
        _check_ids(topk_ids, w13.shape[0])
    T, H = hidden.shape
    if T == 0:
        return
    E, I, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    P = T * k
    t = plan.tiles
    id0, id1 = topk_ids.stride()
    if t.direct:
        sorted_ids = block_expert = topk_ids  # unread
    else:
        sorted_ids, block_expert = _group(plan, topk_ids, P, E, k, id0, id1)
    inter = torch.empty((P, I), dtype=hidden.dtype, device=hidden.device)
    part = torch.empty((P, H), dtype=torch.float32, device=hidden.device)
    b13 = w13 if w13_bias is None else w13_bias
    b2 = w2 if w2_bias is None else w2_bias
    plan.gate_up(hidden, w13, b13, sorted_ids, block_expert, topk_ids, inter,
                 P, H, I, E, k, plan.num_blocks,
                 hidden.stride(0), w13.stride(0), w13.stride(1), b13.stride(0), id0, id1, alpha, limit)
    faults = validate.fault_buffer(hidden.device)
    plan.down(inter, w2, b2, topk_weights, sorted_ids, block_expert, topk_ids, part, faults,
              P, H, I, E, k, plan.num_blocks,
              w2.stride(0), w2.stride(1), b2.stride(0), topk_weights.stride(0), topk_weights.stride(1), id0, id1)
    plan.sum_k(part, out, H, k, out.stride(0))


def _group(plan: _Plan, topk_ids, P: int, E: int, k: int, id0: int, id1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert, three launches and a memset on the device, no host sync:
    ``(sorted_ids int32 [num_blocks * BM], block_expert int32 [num_blocks])``. Expert ``e``'s pairs
    fill a run of slots padded to a multiple of BM (in any order within it); ids outside ``[0, E)``
    form one more run, expert ``E``; pad slots hold ``P``; blocks past the last run have expert -1."""
    bm, dev = plan.tiles.bm, topk_ids.device
    counts = torch.zeros(2 * plan.block_e, dtype=torch.int32, device=dev)
    cursor = counts[plan.block_e:]
    sorted_ids = torch.empty(plan.num_blocks * bm, dtype=torch.int32, device=dev)
    block_expert = torch.empty(plan.num_blocks, dtype=torch.int32, device=dev)
    plan.count(topk_ids, counts, P, E, k, id0, id1)
    plan.offsets(counts, cursor, sorted_ids, block_expert, P, E, plan.num_blocks)
    plan.scatter(topk_ids, cursor, sorted_ids, P, E, k, id0, id1)
    return sorted_ids, block_expert


def _fault_code() -> int:
    """The fault buffer's entry for invalid expert ids (a plan keeps it: tests may move it)."""
    return validate.FAULT_TOPK_IDS


def _check_ids(topk_ids: torch.Tensor, E: int) -> None:
    """The debug mode's value check (reads the device)."""
    if topk_ids.numel() and bool(((topk_ids < 0) | (topk_ids >= E)).any()):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        raise ValueError(f"topk_ids: expected expert ids in [0, {E}) (E, w13's first dim), got ids in [{lo}, {hi}]")


_op = custom_ops.implement("fused_moe", _launch)


def _activation(activation) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


def _finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < float("inf"):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, activation: str = "silu", w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, alpha: float = 1.702, limit: float = 7.0,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' MLP of a mixture-of-experts layer, weighted and summed per token.

    hidden ``[T, H]`` fp16/bf16/fp32; w13 ``[E, 2I, H]`` (gate rows ``0..I-1``, up rows ``I..2I-1``:
    vLLM's layout), w2 ``[E, H, I]``, both in hidden's dtype (last dim contiguous, other strides
    free); topk_weights fp32 ``[T, k]`` and topk_ids int32/int64 ``[T, k]`` (from :func:`route`).
    Returns ``[T, H]`` in hidden's dtype (``out``, written and returned, if given)::

        sum_j topk_weights[t, j] * (act(x W_gate[e]^T + b_gate, x W_up[e]^T + b_up) W2[e]^T + b2[e]),  e = topk_ids[t, j]

    activation ``"silu"``: ``silu(g) * u`` (Mixtral, Qwen3-MoE; no biases). ``"swigluoai"`` (GPT-OSS):
    ``g = min(g, limit); u = clamp(u, -limit, limit); (u + 1) * g * sigmoid(alpha * g)``, with
    optional biases w13_bias ``[E, 2I]`` (gate then up) and w2_bias ``[E, H]``, both or neither.
    The activation is rounded to hidden's dtype (the intermediate); each pair's weighted output and
    the sum over k are fp32. No host sync (CUDA-graph safe). An id outside ``[0, E)`` makes its
    token's row NaN (refused on the host in the debug mode ``validate.value_checks(True)``)."""
    act = _activation(activation)
    alpha, limit = _finite("alpha", alpha), _finite("limit", limit)
    if custom_ops.via_operator():
        _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, act, out)
    if out is None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, act, out)  # says what is wrong
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    elif isinstance(out, torch.Tensor):  # programs write out while others still read the inputs
        validate.check_out_separate(out, dict(hidden=hidden, w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias))
    _op(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, act, alpha, limit, out)
    return out


def route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts: router_logits ``[T, E]`` (any float dtype) -> ``(topk_weights fp32
    [T, top_k], topk_ids int32 [T, top_k])``, in fp32 on the logits' device, no host sync.

    scoring ``"softmax"``: softmax over E, then the top k; ``renormalize`` divides the k weights by
    their sum (Mixtral; Qwen3-MoE's ``norm_topk_prob``). ``"topk_softmax"`` (GPT-OSS): the top k
    logits, then a softmax over those k (already normalized). ``bias`` ``[E]`` is added to the
    logits first. Ties go to ``torch.topk``'s choice."""
    validate.check_tensor("router_logits", router_logits, ndim=2, dtypes=validate.SUPPORTED_DTYPES)
    E = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected an int in [1, {E}] (E, router_logits' last dim), got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {list(SCORINGS)}, got {scoring!r}")
    logits = router_logits.float()
    if bias is not None:
        validate.check_tensor("bias", bias, ndim=1, dtypes=validate.SUPPORTED_DTYPES, device=router_logits.device)
        if bias.shape[0] != E:
            raise ValueError(f"bias: expected shape ({E},) (one per expert), got {tuple(bias.shape)}")
        logits = logits + bias.float()
    if scoring == "softmax":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    return weights, ids.to(torch.int32)

"""Fused mixture-of-experts layer: routing, token grouping by expert, and the expert MLP as two
grouped GEMMs (issue 33). Dimensions: ``T`` tokens, ``H`` hidden size, ``E`` experts, ``I`` an
expert's intermediate size, ``k`` = ``top_k`` experts per token, ``P = T * k`` (token, slot) pairs.
This module holds the expert GEMMs, their launch choices and the public API; routing and the
grouping kernels live in :mod:`pagedflash.ops.moe_routing` (``route`` is re-exported here).

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
- *sorted*: pairs grouped by expert (:func:`.moe_routing.group`: three small kernels), each
  expert's run padded to a multiple of ``BM``; block ``m`` holds ``BM`` slots of one expert (pad
  slots hold the sentinel ``P``). The padded length is bounded on the host by ``P + min(E + 1, P) *
  (BM - 1)``; blocks past the device's true end have expert ``-1`` and their programs return at once, so empty experts
  cost one early exit per program slot.

Invalid expert ids (outside ``[0, E)``, possible only with value checks off: the debug mode
:func:`pagedflash.validate.value_checks` refuses them on the host) read no weight: their pair's
contribution is NaN, so the token's output row is NaN, and the token is recorded in the fault
buffer (``validate.FAULT_TOPK_IDS``: :func:`pagedflash.validate.raise_if_invalid` names it). Pad
rows of a block read ``x``'s row 0 (or the intermediate's) and are never stored; every ragged edge
along ``H`` and ``I`` is masked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedflash import batch_invariance, validate
from pagedflash.ops import custom_ops, moe_routing
from pagedflash.ops._jit import dot_over_k, report_fault
from pagedflash.ops.moe_routing import SCORINGS, route  # noqa: F401  (the layer's API: routing, then fused_moe)
from pagedflash.ops.utils import Launch, PlanCache, cdiv, check_operand, next_pow2

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
    NUM_STAGES: tl.constexpr,
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
    acc = dot_over_k(acc, p_a, p_w, I, BK, EVEN_K, DOT_PRECISION, NUM_STAGES)
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


def tiles(T: int, top_k: int, E: int, invariant: bool = False) -> Tiles:
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
    Unmeasured guesses on the H200: ``pagedflash bench moe`` is the measure, :data:`TILES` the override.

    ``invariant`` (batch-invariant mode): one tile for every ``T``, so that a pair's sums run in the
    same order whatever the other tokens (the grouping moves a pair between blocks and rows, which
    does not change its arithmetic)."""
    if TILES is not None:
        return TILES
    direct = T == 1 or T * top_k * 4 <= E
    if invariant:
        return Tiles(direct, 64, 64, 128, 64, 4, 3, 8)
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
    grouping: moe_routing.Grouping  # its num_blocks: pairs (direct) or the padded bound / bm (sorted)
    gate_up: Launch
    down: Launch
    sum_k: Launch

    @property
    def num_blocks(self) -> int:
        return self.grouping.num_blocks


def _plan(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation: int, out,
          invariant: bool = False) -> _Plan:
    """Check the operands (all the checks read is in the plan's key) and work out the launches."""
    _check(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation, out)
    T, H = hidden.shape
    E, I, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    P = T * k
    t = tiles(T, k, E, invariant)
    num_blocks = P if t.direct else moe_routing.sorted_blocks(P, E, t.bm)
    consts = dict(HAS_BIAS=w13_bias is not None, SORTED=not t.direct,
                  DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", BM=t.bm, BK=t.bk,
                  GROUP_M=t.group_m)
    opts = dict(num_warps=t.warps, num_stages=t.stages)
    nothing = T == 0
    gate_up = Launch(_gate_up_kernel, None if nothing else (num_blocks * cdiv(I, t.bn13),),
                     dict(consts, ACT=activation, EVEN_K=H % t.bk == 0, BN=t.bn13), **opts)
    down = Launch(_down_kernel, None if nothing else (num_blocks * cdiv(H, t.bn2),),
                  dict(consts, EVEN_K=I % t.bk == 0, BN=t.bn2, FAULT=_fault_code(), NUM_STAGES=t.stages), **opts)
    block_h = min(1024, next_pow2(H))
    sum_k = Launch(_sum_k_kernel, None if nothing else (T, cdiv(H, block_h)), dict(BLOCK_H=block_h))
    grouping = moe_routing.plan_grouping(P, E, t.bm, num_blocks, launch=not (nothing or t.direct))
    return _Plan(t, grouping, gate_up, down, sum_k)


_PLANS = PlanCache()


def _launch(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation: int, alpha: float,
            limit: float, out, batch_invariant: bool = False) -> None:
    key = _PLANS.key(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, out,
                     extra=(activation, TILES, _fault_code(), batch_invariant))
    plan = _PLANS.get(key) or _PLANS.add(key, _plan(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias,
                                                    activation, out, batch_invariant))
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
    """The plan's pairs grouped by expert (:func:`.moe_routing.group`)."""
    return moe_routing.group(plan.grouping, topk_ids, P, E, k, id0, id1)


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
              out: torch.Tensor | None = None, batch_invariant: bool | None = None) -> torch.Tensor:
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
    token's row NaN (refused on the host in the debug mode ``validate.value_checks(True)``).
    ``batch_invariant``: each token's row the same bits whatever the other tokens (one tile for every
    T: :func:`tiles`); None: the process-wide default (:mod:`pagedflash.batch_invariance`)."""
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
    _op(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, act, alpha, limit, out,
        batch_invariance.resolve(batch_invariant))
    return out

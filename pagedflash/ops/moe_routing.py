"""Routing for the fused mixture-of-experts layer (:mod:`pagedflash.ops.moe`): each token's experts
(:func:`route`), and the ``P = T * k`` (token, slot) pairs grouped by expert for the expert GEMMs'
*sorted* form (:func:`plan_grouping`, :func:`group`). Dimensions as in :mod:`pagedflash.ops.moe`.

Routing, one launch with no host sync (CUDA-graph safe; the ``torch.ops.pagedflash.moe_route``
operator under ``torch.compile``): ``_route_kernel``, one program per ``BLOCK_T`` tokens, each
token's ``E`` logits (plus the bias) one fp32 row of ``BLOCK_E = next_pow2(E)`` lanes in registers;
the top ``k`` by ``k`` rounds of (the row's maximum among the experts not yet taken, the lowest
index holding it, taken), then the softmax and the weights' normalization over the row or the ``k``.
The tile (``BLOCK_T``, warps) follows from ``E`` alone and rows never mix, so a token's bits never
depend on the other tokens (batch-invariant in every mode). They may depend on the logits' strides
and alignment where a sum runs over the row's lanes (plain softmax, not renormalized: the compiled
load's layout orders it); the k-slot sums add in rank order. On a GPU ``exp`` and the division are
the fast approximate instructions: weights within ~1e-6 relative of torch's.

Grouping, on the device with no host sync (CUDA-graph safe): expert ``e``'s pairs fill a run of
slots padded to a multiple of ``BM`` (in any order within it); ids outside ``[0, E)`` form one more
run, expert ``E``; pad slots hold the sentinel ``P``; blocks past the last run have expert ``-1``.
With half tails (``Grouping.half``) runs are padded to ``BM / 2`` only, and a run's last block
holds ``BM / 2`` slots where its count needs no more (the expert GEMMs then run that block with a
half-height tile: less padding in the matrix products). Each block's run, first slot and slot
count are written out. Three small kernels and a memset: ``_count_kernel`` (pairs per run),
``_offsets_kernel`` (one program: run starts, each block's run, first slot and slots, the pad
slots) and ``_scatter_kernel`` (each pair into a slot of its run). The padded length is bounded on
the host by ``P + min(E + 1, P) * (BM - 1)`` (:func:`sorted_blocks`), never read back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import custom_ops
from pagedflash.ops._jit import NEG_INF, max_first_index
from pagedflash.ops.utils import Launch, PlanCache, cdiv, next_pow2

SCORINGS = ("softmax", "topk_softmax")  # route's scoring; the operator takes its index
MAX_EXPERTS = 4096  # route's kernel holds a token's E logits in registers: up to here


# ---------------------------------------------------------------- grouping kernels


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
    BlockStart,  # [num_blocks] int32: each block's first slot
    BlockSlots,  # [num_blocks] int32: each block's slots, BM or (HALF, a run's last) BM // 2
    P, E, num_blocks,
    BM: tl.constexpr, HALF: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """One program: runs padded to BM (HALF: to BM // 2), each block's run, first slot and slots,
    and the pad slots (disjoint from the slots _scatter_kernel fills, so the two need no ordering)."""
    UNIT: tl.constexpr = BM // 2 if HALF else BM
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(Counts + e)
    padded = (counts + (UNIT - 1)) // UNIT * UNIT
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(Cursor + e, starts)
    blocks = (padded + (BM - 1)) // BM  # of each run
    block_ends = tl.cumsum(blocks, 0)
    for b0 in range(0, num_blocks, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        blk_ok = blk < num_blocks
        run = tl.sum((block_ends[None, :] <= blk[:, None]).to(tl.int32), 1)  # empty runs own no block
        in_run = e[None, :] == run[:, None]
        start = tl.sum(tl.where(in_run, starts[None, :], 0), 1)
        end = tl.sum(tl.where(in_run, ends[None, :], 0), 1)
        count = tl.sum(tl.where(in_run, counts[None, :], 0), 1)
        first = tl.sum(tl.where(in_run, (block_ends - blocks)[None, :], 0), 1)
        s0 = start + (blk - first) * BM
        slots = tl.minimum(end - s0, BM)
        tl.store(BlockExpert + blk, tl.where(run <= E, run, -1), mask=blk_ok)
        tl.store(BlockStart + blk, s0, mask=blk_ok)
        tl.store(BlockSlots + blk, slots, mask=blk_ok)
        slot = s0[:, None] + tl.arange(0, BM)[None, :]
        pad = (slot - start[:, None] >= count[:, None]) & (slot - s0[:, None] < slots[:, None])
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


class Grouping(NamedTuple):
    """The grouping launches of one call signature (grids None: nothing to group)."""

    bm: int  # slots per row block
    half: bool  # a run's last block BM // 2 slots where that holds its pairs
    num_blocks: int  # row blocks: the padded bound / bm
    block_e: int  # lanes of the kernels' per-run vectors (E + 1 runs)
    count: Launch
    offsets: Launch
    scatter: Launch


def sorted_blocks(P: int, E: int, bm: int) -> int:
    """Row blocks of ``bm`` slots that ``P`` pairs grouped by expert can take: each of the ``E``
    runs and the run of invalid ids padded to ``bm``, at most ``min(E + 1, P)`` of them non-empty
    (half tails take no more blocks: a run of ``c`` pairs takes ``cdiv(c, bm)`` either way)."""
    return cdiv(P + min(E + 1, P) * (bm - 1), bm)


def plan_grouping(P: int, E: int, bm: int, num_blocks: int, *, launch: bool, half: bool = False) -> Grouping:
    """The grouping launches for ``P`` pairs over ``E`` experts in ``num_blocks`` blocks of ``bm``
    (``half``: half tails); ``launch`` False: none (direct form, or no token)."""
    if half and bm % 2:
        raise ValueError(f"half tails need an even block height, got bm={bm}")
    block_p = min(1024, next_pow2(P))
    block_e = max(4, next_pow2(E + 1))
    count = Launch(_count_kernel, (cdiv(P, block_p),) if launch else None, dict(BLOCK=block_p))
    offsets = Launch(_offsets_kernel, (1,) if launch else None,
                     dict(BM=bm, HALF=half, BLOCK_E=block_e, BLOCK_B=max(1, min(32, 4096 // block_e))))
    scatter = Launch(_scatter_kernel, (cdiv(P, block_p),) if launch else None, dict(BLOCK=block_p))
    return Grouping(bm, half, num_blocks, block_e, count, offsets, scatter)


class Grouped(NamedTuple):
    """:func:`group`'s layout, int32 tensors on the ids' device."""

    sorted_ids: torch.Tensor  # [num_blocks * BM]: pair ids by run, pad slots P (slots past the last run unwritten)
    block_expert: torch.Tensor  # [num_blocks]: each block's run (E: invalid ids), -1 past the last
    block_start: torch.Tensor  # [num_blocks]: each block's first slot (undefined past the last run)
    block_slots: torch.Tensor  # [num_blocks]: each block's slots, BM or BM // 2 for a half tail (likewise)


def group(g: Grouping, topk_ids, P: int, E: int, k: int, id0: int, id1: int) -> Grouped:
    """Pairs grouped by expert (the module's layout), from ``topk_ids`` ``[T, k]`` of strides
    ``(id0, id1)``."""
    dev = topk_ids.device
    counts = torch.zeros(2 * g.block_e, dtype=torch.int32, device=dev)
    cursor = counts[g.block_e:]
    sorted_ids = torch.empty(g.num_blocks * g.bm, dtype=torch.int32, device=dev)
    block_expert, block_start, block_slots = torch.empty(3, g.num_blocks, dtype=torch.int32, device=dev)
    g.count(topk_ids, counts, P, E, k, id0, id1)
    g.offsets(counts, cursor, sorted_ids, block_expert, block_start, block_slots, P, E, g.num_blocks)
    g.scatter(topk_ids, cursor, sorted_ids, P, E, k, id0, id1)
    return Grouped(sorted_ids, block_expert, block_start, block_slots)


# ---------------------------------------------------------------- routing kernel


@triton.jit
def _route_kernel(
    Logits,  # [T, E] fp16/bf16/fp32, strides (stride_lt, stride_le)
    Bias,  # [E], stride stride_b (read with HAS_BIAS)
    Weights,  # [T, TOP_K] fp32, contiguous
    Ids,  # [T, TOP_K] int32, contiguous
    T, E, stride_lt, stride_le, stride_b,
    TOP_K: tl.constexpr, OVER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """:func:`route`'s rule for ``BLOCK_T`` tokens, each row alone (no reduction across rows). Each
    weight is ``exp(x - max)`` over a sum: the row's with ``OVER_ROW`` (softmax), else the k's
    (softmax renormalized over the k, which is topk_softmax)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = (cols < E)[None, :]
    x = tl.load(Logits + rows.to(tl.int64)[:, None] * stride_lt + cols.to(tl.int64)[None, :] * stride_le,
                mask=row_ok[:, None] & col_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(Bias + cols.to(tl.int64) * stride_b, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    nan = x != x
    has_nan = tl.max(nan.to(tl.int32), 1) > 0
    x = tl.where(nan | ~col_ok, NEG_INF, x)  # a NaN ranks as -inf (its row's weights are NaN below)
    row_max = tl.max(x, 1)  # exact in any order; -inf or +inf make the row's weights NaN
    # top k: round j takes the largest logit left, the lowest index among equals; the k weights' sum
    # is added in that order (no reduction tree: the same bits whatever the load's layout)
    slot = tl.arange(0, BLOCK_K)[None, :]
    top = tl.full([BLOCK_T, BLOCK_K], NEG_INF, tl.float32)  # slots past TOP_K stay -inf
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    den = tl.zeros([BLOCK_T], tl.float32)
    left = tl.broadcast_to(col_ok, [BLOCK_T, BLOCK_E])  # the experts not taken yet
    for j in range(TOP_K):
        m, e = max_first_index(x, cols[None, :], left, 1)
        top = tl.where(slot == j, m[:, None], top)
        top_ids = tl.where(slot == j, e[:, None], top_ids)
        den += tl.exp(m - row_max)
        left = left & (cols[None, :] != e[:, None])
    num = tl.exp(top - row_max[:, None])  # 0 in the slots past TOP_K (a finite row_max)
    if OVER_ROW:  # a reduction over the row's lanes: its order follows the load's layout (strides)
        den = tl.sum(tl.exp(x - row_max[:, None]), 1)  # its padding lanes add 0
    w = tl.where(has_nan[:, None], float("nan"), num / den[:, None])
    out = rows.to(tl.int64)[:, None] * TOP_K + slot
    store_ok = row_ok[:, None] & (slot < TOP_K)
    tl.store(Weights + out, w, mask=store_ok)
    tl.store(Ids + out, top_ids, mask=store_ok)


def _check(router_logits, top_k, bias) -> None:
    validate.check_tensor("router_logits", router_logits, ndim=2, dtypes=validate.SUPPORTED_DTYPES)
    E = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected an int in [1, {E}] (E, router_logits' last dim), got {top_k!r}")
    if E > MAX_EXPERTS:
        raise ValueError(f"router_logits: expected at most {MAX_EXPERTS} experts (its last dim: the routing kernel "
                         f"holds a token's logits in registers), got shape {tuple(router_logits.shape)}")
    if bias is not None:
        validate.check_tensor("bias", bias, ndim=1, dtypes=validate.SUPPORTED_DTYPES, device=router_logits.device)
        if bias.shape[0] != E:
            raise ValueError(f"bias: expected shape ({E},) (one per expert), got {tuple(bias.shape)}")
    validate.check_no_grad(router_logits=router_logits, bias=bias)


def _plan(router_logits, bias, top_k: int, scoring: int, renormalize: bool) -> Launch:
    """Check the operands (all the checks read is in the plan's key) and work out the launch: the
    tile from E alone (batch invariance: the module's doc), about 1024 logits a program."""
    _check(router_logits, top_k, bias)
    T, E = router_logits.shape
    block_e = next_pow2(E)
    block_t = max(1, min(64, 1024 // block_e))
    return Launch(_route_kernel, (cdiv(T, block_t),) if T else None,
                  dict(TOP_K=top_k, OVER_ROW=scoring == 0 and not renormalize, HAS_BIAS=bias is not None,
                       BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=next_pow2(top_k)),
                  num_warps=4 if block_e <= 1024 else 8)


_PLANS = PlanCache()


def _launch(router_logits, bias, top_k: int, scoring: int, renormalize: bool):
    key = _PLANS.key(router_logits, bias, extra=(top_k, scoring, renormalize))
    plan = _PLANS.find(key) or _PLANS.add(key, _plan(router_logits, bias, top_k, scoring, renormalize))
    T, E = router_logits.shape
    weights = router_logits.new_empty((T, top_k), dtype=torch.float32)
    ids = router_logits.new_empty((T, top_k), dtype=torch.int32)
    b = router_logits if bias is None else bias
    plan(router_logits, b, weights, ids, T, E, *router_logits.stride(), b.stride(0))
    return weights, ids


_op = custom_ops.implement("moe_route", _launch)


def route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts: router_logits ``[T, E]`` (fp16/bf16/fp32, any strides, ``E <=``
    :data:`MAX_EXPERTS`) -> ``(topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k])`` on the
    logits' device, in one kernel with no host sync (CUDA-graph safe).

    In fp32, with ``x = logits + bias`` (``bias`` ``[E]``, optional): the experts are the ``top_k``
    largest ``x`` in descending order (``torch.topk``'s ``sorted=True``); equal values go lowest
    index first (a stable descending sort: bf16 logits do tie). scoring ``"softmax"``: each weight
    is ``softmax(x)`` over the E experts; ``renormalize`` divides the k weights by their sum
    (Mixtral; Qwen3-MoE's ``norm_topk_prob``). ``"topk_softmax"`` (GPT-OSS): a softmax over the k
    chosen ``x`` (already normalized). The softmax is monotone, so ranking ``x`` ranks the
    probabilities; the order of experts whose distinct logits round to one probability follows ``x``.

    A NaN in a token's ``x`` ranks as ``-inf`` and makes all k of its weights NaN; a row whose
    maximum is ``-inf`` (all ``-inf``) or ``+inf`` gets NaN weights too (as ``torch.softmax``). Ids
    are always ``top_k`` distinct experts in ``[0, E)``, so the expert kernels read no wild weight.
    Each token's row is computed alone: the same bits whatever the other tokens. Checked on a call
    signature's first call (and when traced); ``pagedflash.reference.moe_route_ref`` is the same
    rule in torch ops."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {list(SCORINGS)}, got {scoring!r}")
    renormalize = bool(renormalize)
    if custom_ops.via_operator():
        _check(router_logits, top_k, bias)
    return _op(router_logits, bias, top_k, SCORINGS.index(scoring), renormalize)

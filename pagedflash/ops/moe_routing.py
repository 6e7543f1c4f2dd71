"""Routing for the fused mixture-of-experts layer (:mod:`pagedflash.ops.moe`): each token's experts
(:func:`route`), and the ``P = T * k`` (token, slot) pairs grouped by expert for the expert GEMMs'
*sorted* form (:func:`plan_grouping`, :func:`group`). Dimensions as in :mod:`pagedflash.ops.moe`.

Grouping, on the device with no host sync (CUDA-graph safe): expert ``e``'s pairs fill a run of
slots padded to a multiple of ``BM`` (in any order within it); ids outside ``[0, E)`` form one more
run, expert ``E``; pad slots hold the sentinel ``P``; blocks past the last run have expert ``-1``.
Three small kernels and a memset: ``_count_kernel`` (pairs per run), ``_offsets_kernel`` (one
program: run starts, each block's run, the pad slots) and ``_scatter_kernel`` (each pair into a
slot of its run). The padded length is bounded on the host by ``P + min(E + 1, P) * (BM - 1)``
(:func:`sorted_blocks`), never read back.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops.utils import Launch, cdiv, next_pow2

SCORINGS = ("softmax", "topk_softmax")


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


class Grouping(NamedTuple):
    """The grouping launches of one call signature (grids None: nothing to group)."""

    bm: int  # slots per row block
    num_blocks: int  # row blocks: the padded bound / bm
    block_e: int  # lanes of the kernels' per-run vectors (E + 1 runs)
    count: Launch
    offsets: Launch
    scatter: Launch


def sorted_blocks(P: int, E: int, bm: int) -> int:
    """Row blocks of ``bm`` slots that ``P`` pairs grouped by expert can take: each of the ``E``
    runs and the run of invalid ids padded to ``bm``, at most ``min(E + 1, P)`` of them non-empty."""
    return cdiv(P + min(E + 1, P) * (bm - 1), bm)


def plan_grouping(P: int, E: int, bm: int, num_blocks: int, *, launch: bool) -> Grouping:
    """The grouping launches for ``P`` pairs over ``E`` experts in ``num_blocks`` blocks of ``bm``;
    ``launch`` False: none (direct form, or no token)."""
    block_p = min(1024, next_pow2(P))
    block_e = max(4, next_pow2(E + 1))
    count = Launch(_count_kernel, (cdiv(P, block_p),) if launch else None, dict(BLOCK=block_p))
    offsets = Launch(_offsets_kernel, (1,) if launch else None,
                     dict(BM=bm, BLOCK_E=block_e, BLOCK_B=max(1, min(32, 4096 // block_e))))
    scatter = Launch(_scatter_kernel, (cdiv(P, block_p),) if launch else None, dict(BLOCK=block_p))
    return Grouping(bm, num_blocks, block_e, count, offsets, scatter)


def group(g: Grouping, topk_ids, P: int, E: int, k: int, id0: int, id1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert (the module's layout), from ``topk_ids`` ``[T, k]`` of strides
    ``(id0, id1)``: ``(sorted_ids int32 [num_blocks * BM], block_expert int32 [num_blocks])``."""
    dev = topk_ids.device
    counts = torch.zeros(2 * g.block_e, dtype=torch.int32, device=dev)
    cursor = counts[g.block_e:]
    sorted_ids = torch.empty(g.num_blocks * g.bm, dtype=torch.int32, device=dev)
    block_expert = torch.empty(g.num_blocks, dtype=torch.int32, device=dev)
    g.count(topk_ids, counts, P, E, k, id0, id1)
    g.offsets(counts, cursor, sorted_ids, block_expert, P, E, g.num_blocks)
    g.scatter(topk_ids, cursor, sorted_ids, P, E, k, id0, id1)
    return sorted_ids, block_expert


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

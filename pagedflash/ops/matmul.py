"""Batch-invariant linear layer: ``x @ weight.T + bias`` whose output row ``i`` is bitwise the same
whatever the number of rows ``M`` and wherever row ``i`` sits in ``x`` (issue 32, item 2).

The rule. An output element is a sum over ``K``; floating-point addition is not associative, so the
element's bits depend on the order of that sum. cuBLAS (and any autotuned GEMM) picks its kernel,
tile shape and split of ``K`` from ``M``: a row computed in a batch of 1 and in a batch of 256 is
summed in different orders, and greedy decoding then depends on what else is served. Here:

- one MMA instruction for every ``M``: the 64-row wgmma of one warpgroup on sm90 (Triton emits it
  for ``BLOCK_M >= 64`` with 4+ warps), from a weight's tile (:func:`tile`: ``N``, ``K``, the dtype
  and the device only) whose columns, K steps and stages :func:`decode_tile` and :func:`rows_tile`
  change by ``M``, and whose rows the latter doubles with a second warpgroup: neither enters a row's
  bits (below);
- no split of ``K`` that follows ``M``: each output tile is reduced over ``K`` in ``BLOCK_K`` steps
  in increasing order into one fp32 accumulator; the bias is added after the loop, then one rounding
  to x's dtype. With :data:`CHUNK_K` (off by default: on an H100 0.85-1.23x the tile's speed at
  M = 1, 1.6-1.9x slower from M = 256, docs/performance.md v38) a layer whose column tiles
  leave SMs idle sums ``K`` in fixed chunks (``Tile.chunk_k``, from ``N``, ``K`` and the SM count),
  each chunk from zero, the chunks' sums added in order after a zero; a few output tiles run one
  program per (tile, chunk) and a fold kernel adds the fp32 partials, many tiles one program per
  tile adding its own chunks: the same operations, so the same bits, whichever form ``M`` picks. A
  row's position inside its tile does not change its arithmetic (rows past ``M`` are zeros, never
  read from memory nor stored; they do not enter any other row's sums);
- persistent: ``min(tiles, SMs)`` programs walk the output tiles in one fixed order (8 row blocks
  at a time over the column blocks, for L2 reuse). Which program computes a tile does not change
  the tile's arithmetic, so the grid may follow ``M`` while the bits do not;
- ``M`` is not specialized (``do_not_specialize``): one compiled kernel a tile, whatever the batch
  size (a weight has up to six tiles over M = 1..8192; the engine's warm-up compiles them), no
  recompilation as a serving loop's batch changes. ``N`` and ``K`` are (they are fixed per layer).
- with :data:`DECODE_TILES` (on by default), calls of at most ``BLOCK_M`` rows (decode) run
  :func:`decode_tile`: the same tile with fewer columns (and, at 16 columns, deeper K steps), so
  that a narrow layer's column tiles fill the SMs at M = 1; with :data:`ROW_TILES` (on by
  default), calls of more rows run :func:`rows_tile`: 128 rows of two warpgroups where their tiles
  reach half the SMs, else the weight's tile narrowed as decode tiles are, for its row tiles too.
  What orders a row's sum stays: the MMA instruction a warpgroup issues and the K chunks. An MMA
  computes each output element from its row, its column and its accumulator alone, in 16-deep K
  steps chained in increasing K through one accumulator, so neither the tile's width, its rows nor
  its ``BLOCK_K`` (a multiple of 16) enter the element's bits; ``tools/tune_matmul.py`` checks that
  on the device (every timed tile's output against the first's, bit for bit: on an H100 all 32
  swept tiles, 16-256 columns, 64-256-deep K steps, 4 and 8 warps, agreed on every weight,
  docs/performance.md v41, and the 128-row tiles, v48) and ``tests/test_matmul.py`` checks rows
  across the tiles (under the interpreter with a dot that chains 16-deep steps,
  :func:`pagedflash.testing.row_exact_interpreter_dot`);
- on sm90 in 16-bit, :data:`WARP_TILE_SM90` (with :data:`DECODE_TILES`): calls of at most 16 rows,
  on the layers whose decode tile has narrowed to 16 columns, run a tile of two warps issuing the warp's MMA
  (``mma.sync``), not the warpgroup's: the same 16-deep K steps through another instruction, which
  an H100 rounds as it rounds wgmma (``tools/tune_matmul.py --warp-sweep``: every tile's bits equal
  on the 1B shape's five weights; the attention's decode tile relies on the same, docs/performance.md
  v59); ``PAGEDFLASH_MATMUL_WARP_TILE`` (:data:`WARP_TILE`) names another such tile for every device
  (``0``: none anywhere);
- with ``act``, the weight is a gated MLP's gate/up projection and the result ``act(gate) * up``:
  each tile computes gate and up columns side by side (the same sums, rounded as the plain tile
  rounds them) and its epilogue applies the activation kernel's own arithmetic
  (:func:`pagedflash.ops._jit.gated_product`), so the result has the bits of the plain GEMM followed
  by :func:`pagedflash.ops.activation.act_mul`, without that launch nor the ``[M, 2n]`` product
  written and read back.

fp32 inputs use IEEE fp32 products (``input_precision="ieee"``, not TF32), as ``torch.mm`` does by
default. References: :func:`pagedflash.reference.matmul_ref`; tests: ``tests/test_matmul.py``.

Cost on the H200 (``tools/tune_matmul.py``: Llama-3-8B's projections at ``M = 1, 32, 256, 8192``
against ``torch.mm``, docs/performance.md v36): with the first tiles (64x64 or 64x128, 64-deep, 4
stages) 0.27-0.65x cuBLAS's speed at every M (M = 1: 0.7-1.9 TB/s); the sweep's best tiles, now the
default on sm90 (:func:`tile`), 0.44-0.95x, geometric means 0.74 (gate/up) and 0.55 (down). Rows
past M are masked, never read: reading row 0 in their place costs 64 reads of the same bytes a K
step from every SM, which held M <= 32 near 0.5x whatever the tile (v41); at M = 64 the narrow
decode tiles reach 0.96-1.08x on an H100, and from M = 96 to 8192 the row tiles 0.65-0.99x on the 1B
shape (v48).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import _jit, custom_ops, scratch
from pagedflash.ops.activation import ACTIVATIONS
from pagedflash.ops.utils import (
    Launch,
    PlanCache,
    cdiv,
    check_operand,
    interpreted,
    next_pow2,
    num_sms,
    nvidia_capability,
)


@triton.jit
def _tile_sum(p_x, m_rows, p_w, K, CHUNK_K, first_chunk, num_chunks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
              CHUNKED: tl.constexpr):
    """One output tile's fp32 sum over K (``p_x`` / ``p_w`` at k = 0; x's rows ``m_rows`` read, the
    others zeros): unchunked, one accumulator over every ``BLOCK_K`` step; chunked, ``0 + sum_c
    (chunk c's own sum from zero)`` over the chunks ``first_chunk .. first_chunk + num_chunks - 1``
    of ``CHUNK_K`` keys, in increasing order."""
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if CHUNKED:
        for c in range(first_chunk, first_chunk + num_chunks):
            k0 = c * CHUNK_K
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            part = _jit.dot_over_k(part, p_x + k0, p_w + k0, tl.minimum(CHUNK_K, K - k0), BLOCK_K, EVEN_K,
                                   DOT_PRECISION, NUM_STAGES, m_rows)
            total += part
    else:
        total = _jit.dot_over_k(total, p_x, p_w, K, BLOCK_K, EVEN_K, DOT_PRECISION, NUM_STAGES, m_rows)
    return total


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    X,  # [M, K], row stride stride_xm
    W,  # [N, K], row stride stride_wn (ACT: gate rows, then as many up rows)
    Bias,  # [N] (HAS_BIAS)
    Out,  # [M, N] (ACT: [M, N / 2]), row stride stride_om; SPLIT: fp32 partials [num_chunks, M, N]
    M, N, K, stride_xm, stride_wn, stride_om, CHUNK_K,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr, CHUNKED: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr,
):
    """Persistent programs over the output tiles; SPLIT (chunked only): over (tile, chunk) pairs, each
    writing its chunk's fp32 sum to the partials, which :func:`_fold_kernel` adds in chunk order.
    ACT (a gated MLP's gate/up projection, not SPLIT): a tile's columns alternate gate and up rows of
    W (column ``2j`` gate row ``c + j``, ``2j + 1`` up row ``N / 2 + c + j``), so that its epilogue
    rounds both products as the plain tile would and stores ``act(gate) * up``
    (:func:`pagedflash.ops._jit.gated_product`) for its ``BLOCK_N / 2`` output columns."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_chunks = 1
    if CHUNKED:
        num_chunks = tl.cdiv(K, CHUNK_K)
    per_group = GROUP_M * num_n
    offs_k = tl.arange(0, BLOCK_K)
    work = num_m * num_n
    if SPLIT:
        work = work * num_chunks
    for item in range(tl.program_id(0), work, tl.num_programs(0)):
        tile_id = item
        if SPLIT:
            tile_id = item // num_chunks
        first_m = (tile_id // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile_id % per_group) % size_m
        pid_n = (tile_id % per_group) // size_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_rows = rows < M
        m_cols = cols < N
        w_rows = cols
        if ACT != "":  # gate and up rows side by side
            w_rows = (cols % 2) * (N // 2) + cols // 2
        # rows past M are zeros, read from nowhere; columns past N read weight row 0: in bounds, never stored
        p_x = X + tl.where(m_rows, rows, 0).to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        p_w = W + tl.where(m_cols, w_rows, 0).to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        mask = m_rows[:, None] & m_cols[None, :]
        if SPLIT:
            chunk = item % num_chunks
            acc = _tile_sum(p_x, m_rows, p_w, K, CHUNK_K, chunk, 1, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION,
                            NUM_STAGES, CHUNKED)
            p_part = Out + (chunk * M + rows).to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(p_part, acc, mask=mask)
        else:
            acc = _tile_sum(p_x, m_rows, p_w, K, CHUNK_K, 0, num_chunks, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION,
                            NUM_STAGES, CHUNKED)
            if HAS_BIAS:
                acc += tl.load(Bias + w_rows, mask=m_cols, other=0.0).to(tl.float32)[None, :]
            y = acc.to(Out.dtype.element_ty)
            if ACT != "":
                gate, up = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
                y = _jit.gated_product(gate, up, ACT)
                cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                mask = m_rows[:, None] & (cols < N // 2)[None, :]
            p_o = Out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
            tl.store(p_o, y, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fold_kernel(Part, Bias, Out, M, N, num_chunks, stride_om, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``0 + sum_c Part[c]`` in chunk order, plus the bias, rounded to Out's dtype: the same operations
    as the unsplit chunked kernel's, so a row's bits do not depend on which form ran."""
    plane = M.to(tl.int64) * N
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < plane
    row = offs // N
    col = offs % N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(num_chunks):
        total += tl.load(Part + c * plane + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(Bias + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_om + col, total.to(Out.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- launch choices


class Tile(NamedTuple):
    """The launch configuration of an ``[N, K]`` weight (:func:`tile`), and of a call's rows
    (:func:`decode_tile`, :func:`rows_tile`: the same MMA instruction, other columns, K steps, rows)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int
    chunk_k: int = 0  # K in fixed chunks of this many (a multiple of block_k), summed in order; 0: one


BLOCK_M = 64  # a weight's tile: the smallest wgmma tile on sm90 (4 warps); row tiles stack two
TILE: Tile | None = None  # forced tile (tests, tuning); part of every plan's key
# K in fixed chunks where the column tiles alone leave SMs idle (chunk_k of tile()); off by default, as
# measured (module doc; PAGEDFLASH_MATMUL_CHUNK_K=1, or tune_matmul.py --chunk-k); part of every plan's key
CHUNK_K = os.environ.get("PAGEDFLASH_MATMUL_CHUNK_K", "0") == "1"
# calls of at most BLOCK_M rows run decode_tile()'s narrower columns (module doc); on by default
# (PAGEDFLASH_MATMUL_DECODE_TILES=0 turns it off); part of every plan's key
DECODE_TILES = os.environ.get("PAGEDFLASH_MATMUL_DECODE_TILES", "1") != "0"
DECODE_TILE: Tile | None = None  # forced decode tile (also rows_tile's narrowed one); part of every plan's key
# calls of more than BLOCK_M rows run rows_tile() (module doc); on by default
# (PAGEDFLASH_MATMUL_ROW_TILES=0 turns it off); part of every plan's key
ROW_TILES = os.environ.get("PAGEDFLASH_MATMUL_ROW_TILES", "1") != "0"
TALL_TILE: Tile | None = None  # forced 128-row tile (tests, tuning); part of every plan's key


def parse_warp_tile(text: str) -> Tile | None:
    """``PAGEDFLASH_MATMUL_WARP_TILE``'s value ``rows:columns:k_step:warps:stages`` as a tile (group_m
    and chunk_k come from the weight's tile, :func:`warp_tile`), None when empty or ``0``, or a clear
    error."""
    if text.strip() in ("", "0"):
        return None
    try:
        rows, cols, k_step, warps, stages = (int(x) for x in text.split(":"))
    except ValueError:
        rows = cols = k_step = warps = stages = 0
    pow2 = all(v >= 1 and v & (v - 1) == 0 for v in (rows, cols, k_step, warps))
    if not (pow2 and rows >= 16 and cols >= 16 and k_step >= 16 and stages >= 1 and rows <= BLOCK_M):
        raise ValueError(f"PAGEDFLASH_MATMUL_WARP_TILE: expected rows:columns:k_step:warps:stages (powers of two, "
                         f"rows 16 to {BLOCK_M}, columns and K steps at least 16, stages >= 1) or 0, got {text!r}")
    return Tile(rows, cols, k_step, warps, stages, 0)


# calls of at most a warp tile's rows run it (warp_tile): rows of a warp's MMA (mma.sync) rather than a
# warpgroup's wgmma, where batch-1 decode leaves 63 of 64 rows empty. A row keeps its bits only where the
# device's two MMAs round alike (tools/tune_matmul.py --warp-sweep checks it). While
# PAGEDFLASH_MATMUL_WARP_TILE is unset, WARP_TILE_SM90 serves sm90's 16-bit calls with DECODE_TILES (it
# is one more decode tile; the best of v59's sweep on o_proj and down: 0.87 -> 0.96 of cuBLAS at M = 1
# on an H100); the variable's tile (WARP_TILE) serves every device, 0 none. Both are part of every
# plan's key
_WARP_ENV = os.environ.get("PAGEDFLASH_MATMUL_WARP_TILE")
WARP_TILE = parse_warp_tile(_WARP_ENV or "")
SM90_WARP_TILE = Tile(16, 16, 256, 2, 4, 0)  # group_m and chunk_k from the weight's tile
WARP_TILE_SM90 = SM90_WARP_TILE if _WARP_ENV is None else None
# rows_tile: the widest tile whose tiles number at least this share of the SMs. Fewer, wider tiles in
# one partial wave beat more, narrower ones in a fuller wave down to about half the SMs: on an H100 the
# tiles this rule picks for the 1B model's projections ran at 0.65-0.99x cuBLAS from M = 96 to 8192,
# within 0.08 of each weight's best timed tile (docs/performance.md v48)
TALL_FILL = 0.5
DECODE_MIN_N = 16  # decode tiles' columns at least
DECODE_DEEP_K = 256  # K steps of 16-column decode tiles (v41's sweep: o_proj and down's best at M = 64)
SMEM_SM90 = 200 * 1024  # shared memory the sm90 pipeline may fill (of 227 KB a block)
MIN_CHUNK = 1024  # keys per chunk at least: the chunked kernel restarts its K pipeline at each chunk
FOLD_BLOCK = 1024  # elements per program of the chunk fold


def tile(n: int, k: int, dtype: torch.dtype, device: torch.device) -> Tile:
    """The launch configuration from the weight's shape, the dtype and the device only (never ``M``):

    - 64 rows (:data:`BLOCK_M`), 4 warps: one warpgroup, the wgmma of a 64-row tile;
    - 16-bit on sm90: 256 columns by 64-deep K steps in 5 stages from ``N >= 16384``, else 128 by 128
      in 4 (200 / 192 KB of shared memory): the best of `tools/tune_matmul.py --sweep` on the H200
      (Llama-3-8B's projections, geometric mean over M = 1..8192: gate/up 0.53 -> 0.74 of cuBLAS,
      down 0.33 -> 0.55; docs/performance.md v36); wide tiles stream more bytes a program, which
      matters more than the program count even at M = 1;
    - 16-bit elsewhere (unmeasured; sm120's ~99 KB would not hold the sm90 tiles): 128 columns from
      ``N >= 8192``, else 64, by 64, 3 stages on other NVIDIA GPUs, 2 elsewhere;
    - fp32 (IEEE products on the FMA units): 64 columns, 32-deep steps, 4 stages on sm90;
    - columns and steps at least 16 and no wider than ``N`` / ``K`` need;
    - with :data:`CHUNK_K`, where the column tiles are fewer than half the SMs, K in chunks of at
      least :data:`MIN_CHUNK` keys so that tiles x chunks reach the SM count (``chunk_k``; a chunk's
      sum starts from zero, the chunks' sums are added in order: the same bits whether one program
      adds them or one program per chunk writes them and :func:`_fold_kernel` adds them).

    :data:`TILE` overrides it for a sweep."""
    if TILE is not None:
        return TILE
    capability = nvidia_capability(device)
    stages = 4 if capability is not None and capability >= (9, 0) else 3 if capability is not None else 2
    if dtype == torch.float32:
        block_n, block_k = 64, 32
    elif capability is not None and (9, 0) <= capability < (10, 0):  # 227 KB of shared memory a block
        block_n, block_k, stages = (256, 64, 5) if n >= 16384 else (128, 128, 4)
    else:
        block_n, block_k = 128 if n >= 8192 else 64, 64
    block_n = max(16, min(block_n, next_pow2(n)))
    block_k = max(16, min(block_k, next_pow2(k)))
    chunk_k = k_chunk(n, k, block_n, block_k, num_sms(device)) if CHUNK_K else 0
    return Tile(BLOCK_M, block_n, block_k, 4, stages, 8, chunk_k)


def _sm90_wgmma(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``dtype`` on ``device`` runs the sm90 16-bit wgmma tiles that decode and row tiles vary."""
    capability = nvidia_capability(device)
    return dtype != torch.float32 and capability is not None and (9, 0) <= capability < (10, 0)


def decode_tile(main: Tile, n: int, k: int, dtype: torch.dtype, device: torch.device, m: int = 1) -> Tile:
    """The tile of calls with at most ``BLOCK_M`` rows under :data:`DECODE_TILES`: ``main`` (the
    :func:`tile` of the same weight) with its columns halved, down to :data:`DECODE_MIN_N`, while
    twice the output tiles would still fit in the SM count; at 16 columns :data:`DECODE_DEEP_K`-deep
    K steps (where K and the chunks allow), so that a program still streams enough bytes a step; as
    many stages (up to 6) as sm90's shared memory holds. ``m``: the call's rows (more than
    ``BLOCK_M`` from :func:`rows_tile`: the row tiles count too). Only on sm90 in 16-bit (wgmma,
    one warpgroup; elsewhere ``main``). ``block_m``, ``warps``, ``group_m`` and ``chunk_k`` are
    ``main``'s: a row's sum has the same operations in the same order (module doc).
    :data:`DECODE_TILE` overrides it."""
    if DECODE_TILE is not None:
        if DECODE_TILE._replace(block_n=main.block_n, block_k=main.block_k, stages=main.stages) != main:
            raise ValueError(f"matmul.DECODE_TILE: expected {main}'s block_m, warps, group_m and chunk_k (only "
                             f"block_n, block_k and stages may differ: a row's sum must keep its order), "
                             f"got {DECODE_TILE}")
        return DECODE_TILE
    if not _sm90_wgmma(dtype, device):
        return main
    sms, block_n, block_k = num_sms(device), main.block_n, main.block_k
    while block_n > DECODE_MIN_N and 2 * cdiv(m, main.block_m) * cdiv(n, block_n) <= sms:
        block_n //= 2
    if block_n == DECODE_MIN_N and k >= DECODE_DEEP_K and main.chunk_k % DECODE_DEEP_K == 0:
        block_k = max(block_k, DECODE_DEEP_K)
    stages = max(main.stages, min(6, SMEM_SM90 // ((main.block_m + block_n) * block_k * 2)))
    return main._replace(block_n=block_n, block_k=block_k, stages=stages)


def warp_tile(warp: Tile, main: Tile, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Tile | None:
    """The warp tile ``warp`` for the weight whose tile is ``main``: its ``group_m`` and ``chunk_k``,
    columns and K steps no wider than ``N`` / ``K`` need. None where its K steps would cross the chunks,
    and, where the weight has sm90's wgmma decode tiles, where :func:`decode_tile` is wider than the
    warp tile's columns: a warp's tile beats the 64-row tile only on layers narrow enough that decode
    tiles reach its width (on an H100 at batch 1: o_proj and down of the 1B shape 0.87 -> 0.96 of cuBLAS
    at 16 columns; qkv's and gate/up's wider decode tiles 0.95-0.97 against 0.86-0.91; docs/performance.md v59)."""
    if _sm90_wgmma(dtype, device) and decode_tile(main, n, k, dtype, device).block_n > warp.block_n:
        return None
    block_n = max(16, min(warp.block_n, next_pow2(n)))
    block_k = max(16, min(warp.block_k, next_pow2(k)))
    if main.chunk_k % block_k:
        return None
    return warp._replace(block_n=block_n, block_k=block_k, group_m=main.group_m, chunk_k=main.chunk_k)


def rows_tile(main: Tile, m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Tile:
    """The tile of a call of ``m`` > ``BLOCK_M`` rows under :data:`ROW_TILES`: the widest of
    :func:`tall_tile`'s (256, then 128 columns) whose tiles number at least :data:`TALL_FILL` of
    the SMs, else ``main`` narrowed as :func:`decode_tile` narrows it for ``m`` rows (with
    :data:`DECODE_TILES`; it stops at the same half of the SMs). Every choice sums a row's K in
    the same MMA steps (module doc)."""
    sms = num_sms(device)
    for block_n in (256, 128):
        wide = tall_tile(main, n, k, dtype, device, block_n)
        if wide != main and cdiv(m, wide.block_m) * cdiv(n, wide.block_n) >= TALL_FILL * sms:
            return wide
    return decode_tile(main, n, k, dtype, device, m) if DECODE_TILES else main


def tall_tile(main: Tile, n: int, k: int, dtype: torch.dtype, device: torch.device, block_n: int = 256) -> Tile:
    """A tile for calls of many rows (:func:`rows_tile`): two warpgroups of ``main``'s 64-row wgmma
    stacked along M (128 rows, 8 warps), ``block_n`` columns (fewer where ``N`` needs fewer) by
    64-deep K steps (fewer where ``K`` needs fewer; ``main`` itself where they would cross its K
    chunks), as many stages (up to 4) as sm90's shared memory holds: a row's sum has the same
    16-deep MMA steps in the same order as under ``main`` (module doc), with twice the rows a weight
    tile is read for. ``chunk_k`` and ``group_m`` are ``main``'s. Only on sm90 in 16-bit (elsewhere
    ``main``). :data:`TALL_TILE` overrides it."""
    if TALL_TILE is not None:
        if TALL_TILE.chunk_k != main.chunk_k:
            raise ValueError(f"matmul.TALL_TILE: expected chunk_k {main.chunk_k} ({main}'s: a row's sum must "
                             f"keep its order), got {TALL_TILE}")
        return TALL_TILE
    if not _sm90_wgmma(dtype, device):
        return main
    block_m, block_n = 2 * main.block_m, max(16, min(block_n, next_pow2(n)))
    block_k = max(16, min(64, next_pow2(k)))
    if main.chunk_k % block_k:  # its K steps would cross the chunks
        return main
    stages = min(4, SMEM_SM90 // ((block_m + block_n) * block_k * 2))
    return main._replace(block_m=block_m, block_n=block_n, block_k=block_k, warps=8, stages=stages)


def k_chunk(n: int, k: int, block_n: int, block_k: int, sms: int, min_chunk: int = MIN_CHUNK) -> int:
    """The K chunk of :func:`tile`'s rule for a ``block_n`` x ``block_k`` tile: where its column tiles
    are fewer than half of ``sms``, chunks of at least ``min_chunk`` keys (a multiple of ``block_k``)
    so that tiles x chunks reach the SM count; 0 where the rule makes none (or one chunk holds K)."""
    tiles_n = cdiv(n, block_n)
    if 2 * tiles_n >= sms:
        return 0
    chunk = max(min_chunk, cdiv(cdiv(k, cdiv(sms, tiles_n)), block_k) * block_k)
    return chunk if chunk < k else 0


# ---------------------------------------------------------------- host


def _check(x, weight, bias, out, act: str = "") -> None:
    """x ``[M, K]``, weight ``[N, K]`` (with ``act``: N even, gate rows then up rows), bias ``[N]``, out
    ``[M, N]`` (with ``act``: ``[M, N / 2]``): one dtype and device, last dims contiguous, out's rows
    apart; act one of ``ACTIVATIONS`` or none."""
    if act not in ("", *ACTIVATIONS):
        raise ValueError(f"act: expected None or one of {ACTIVATIONS}, got {act!r}")
    check_operand("x", x, (None, None))
    m, k = x.shape
    check_operand("weight", weight, (None, k), like=("x", x))
    n = weight.shape[0]
    if act and n % 2:
        raise ValueError(f"weight: expected an even number of rows with act (gate rows, then as many up rows), "
                         f"got shape {tuple(weight.shape)}")
    if bias is not None:
        check_operand("bias", bias, (n,), like=("x", x))
    if out is not None:
        width = n // 2 if act else n
        check_operand("out", out, (m, width), like=("x", x))
        if m > 1 and out.stride(0) < width:  # an expanded out: programs would race on shared rows
            raise ValueError(f"out: expected rows that do not overlap (row stride >= {width}), "
                             f"got strides {out.stride()}")
    validate.check_no_grad(x=x, weight=weight, bias=bias)


class _Plan(NamedTuple):
    main: Launch  # the GEMM (with ``split``: each (tile, chunk) pair's sum into the partials)
    fold: Launch | None  # with ``split``: the partials added in chunk order, the bias, the rounding
    chunk_k: int
    num_chunks: int


def _plan(x, weight, bias, out, act: str) -> _Plan:
    """Check the operands (all the checks read is in the plan's key; the device's type here, as it
    reads Triton's interpreter switch, which ``torch.compile`` cannot trace) and work out the launch:
    a chunked tile runs one program per (tile, chunk) while the output tiles alone leave SMs idle
    (the split form), else one program per tile adds its chunks itself; both give the same bits.
    ``act``: the gated epilogue, never split (its tiles add their own chunks: the same bits)."""
    _check(x, weight, bias, out, act)
    if x.device.type != "cuda" and not interpreted():
        raise ValueError(f"x: expected a CUDA tensor (a CPU one only under the Triton interpreter, "
                         f"TRITON_INTERPRET=1), got one on {x.device}")
    (m, k), n = x.shape, weight.shape[0]
    t = tile(n, k, x.dtype, x.device)
    wt = WARP_TILE if WARP_TILE is not None else \
        WARP_TILE_SM90 if DECODE_TILES and _sm90_wgmma(x.dtype, x.device) else None
    warp = warp_tile(wt, t, n, k, x.dtype, x.device) if wt is not None and m <= wt.block_m else None
    if warp is not None:
        t = warp
    elif DECODE_TILES and m <= t.block_m:
        t = decode_tile(t, n, k, x.dtype, x.device)
    elif ROW_TILES and m > t.block_m:
        t = rows_tile(t, m, n, k, x.dtype, x.device)
    if t.chunk_k < 0 or t.chunk_k % t.block_k:
        raise ValueError(f"matmul.TILE: chunk_k: expected 0 or a positive multiple of block_k ({t.block_k}), "
                         f"got {t.chunk_k}")
    tiles = cdiv(m, t.block_m) * cdiv(n, t.block_n)
    chunked = 0 < t.chunk_k < k
    num_chunks = cdiv(k, t.chunk_k) if chunked else 1
    sms = num_sms(x.device)
    split = chunked and tiles < sms and not act
    work = tiles * num_chunks if split else tiles
    main = Launch(_matmul_kernel, (min(work, sms),) if work else None,
                  dict(HAS_BIAS=bias is not None, EVEN_K=k % t.block_k == 0,
                       DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                       BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
                       NUM_STAGES=t.stages, CHUNKED=chunked, SPLIT=split, ACT=act),
                  num_warps=t.warps)
    fold = None
    if split and work:
        fold = Launch(_fold_kernel, (cdiv(m * n, FOLD_BLOCK),), dict(HAS_BIAS=bias is not None, BLOCK=FOLD_BLOCK),
                      num_warps=4)
    return _Plan(main, fold, t.chunk_k if chunked else k, num_chunks)


_PLANS = PlanCache()


def plan_key(x, weight, bias, out, act: str = "") -> tuple | None:
    """The key of a call's plan in ``_PLANS``: the operands and every switch that shapes the launch."""
    return _PLANS.key(x, weight, bias, out, extra=(act, TILE, CHUNK_K, DECODE_TILES, DECODE_TILE, ROW_TILES,
                                                       TALL_TILE, TALL_FILL, WARP_TILE, WARP_TILE_SM90))


def _launch(x, weight, bias, out, act: str = "") -> None:
    key = plan_key(x, weight, bias, out, act)
    plan = _PLANS.get(key) or _PLANS.add(key, _plan(x, weight, bias, out, act))
    (m, k), n = x.shape, weight.shape[0]
    b = weight if bias is None else bias
    if plan.fold is None:
        plan.main(x, weight, b, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), plan.chunk_k)
        return
    (part,) = scratch.buffers((((plan.num_chunks, m, n), torch.float32),), x.device)
    plan.main(x, weight, b, part, m, n, k, x.stride(0), weight.stride(0), n, plan.chunk_k)
    plan.fold(part, b, out, m, n, plan.num_chunks, out.stride(0))


_op = custom_ops.implement("matmul", _launch)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, act: str | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, batch-invariant: row ``i`` of the result is bitwise the same for any
    number of rows and any position of the row in ``x`` (module doc).

    x ``[M, K]`` fp16/bf16/fp32; weight ``[N, K]`` (``nn.Linear``'s layout) and bias ``[N]`` (or
    None) in x's dtype and on its device; rows of x and weight may be strided, their last dim must
    be contiguous. Returns ``[M, N]`` in x's dtype, accumulated in fp32; written into ``out``
    (``[M, N]``, x's dtype and device, last dim contiguous, no memory shared with an input) and
    returned, if given. The checks run on a call signature's first call, and at trace time under
    ``torch.compile``; no host sync (CUDA-graph safe).

    ``act`` (``"silu"`` or ``"gelu_tanh"``, :data:`ACTIVATIONS`): weight ``[2n, K]`` is a gated MLP's
    gate/up projection (gate rows first, bias likewise) and the result ``act(gate) * up`` ``[M, n]``,
    bitwise ``activation.act_mul(matmul(x, weight, bias), act)`` in one launch (module doc); out
    ``[M, n]``."""
    act = act or ""
    if custom_ops.via_operator():
        _check(x, weight, bias, out, act)
    if out is None:
        if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or x.dim() != 2 or weight.dim() != 2:
            _check(x, weight, bias, out, act)  # says what is wrong
        out = torch.empty((x.shape[0], weight.shape[0] // 2 if act else weight.shape[0]), dtype=x.dtype,
                          device=x.device)
    elif isinstance(out, torch.Tensor):  # programs write out while others still read the inputs
        validate.check_out_separate(out, dict(x=x, weight=weight, bias=bias))
    _op(x, weight, bias, out, act)
    return out

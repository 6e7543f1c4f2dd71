"""Launch choices for the attention kernel, all in one place: tile shapes and warps per workload,
GQA packing, the number of KV splits, and whether K/V load through Hopper TMA descriptors.

The GPU values come from ``python -m pagedflash bench tune`` on an H200 (docs/performance.md).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from pagedflash.ops.utils import cdiv, descriptor_aligned, interpreted, next_pow2, num_sms, nvidia_capability
from pagedflash.validate import FP8_DTYPES

# Hopper tensor-memory-accelerator loads: contiguous K/V of prefill (dense, varlen) and page pools
# whose pages hold whole 64-key tiles (prefill, and short decode in wide grids); other decode
# launches take pointer tiles (faster there: docs/performance.md, v13 and v14) and smaller pages
# gather rows.
# PAGEDFLASH_TMA=0 turns it off; the pointer path is the portable one and runs everywhere else.
TMA = os.environ.get("PAGEDFLASH_TMA", "1") != "0"
# fp8 K/V (float8_e4m3fn/e5m2) load through pointer tiles; PAGEDFLASH_TMA_FP8=1 loads them through
# descriptors (correct under the interpreter and on the H200; untimed: docs/performance.md, v19, v21).
TMA_FP8 = os.environ.get("PAGEDFLASH_TMA_FP8", "0") == "1"
# The interpreter runs tensor descriptors too (zero fill included): tests turn this on to check the
# descriptor paths on the CPU. Off by default there, since the pointer path is the portable one.
INTERPRET_TMA = False
MAX_SPLITS = 128
# Split-KV decode (`bench tune --only decode` on an H200, docs/performance.md v13-v15): split programs
# stream best with about this many K+V bytes per key step per SM (one program per SM for a 128-wide
# bf16 head, two for a 64-wide one); twice as many over a page pool (block-table reads sit on its
# load path) whose rows are gathered (while each split keeps two tiles, v15), or whose splits would
# stream LONG_KV_KEYS keys or more; a split may be as short as one tile. Prefill tiles keep the
# earlier rule, about two programs per SM rounded up, at least two tiles a split: they are
# compute-bound and were not swept.
KV_BYTES_PER_SM = 512
# A decode program that streams this many keys or more takes 128-key tiles where their stages fit:
# three deep alone on an SM over a contiguous cache, two deep in a wide grid (below it, pipeline fill
# makes them slower than 32- and 64-key tiles: docs/performance.md, v14). Over 64-row pages such
# splits are halved instead (choose_num_splits); smaller pages take 128-key tiles two deep (one-byte
# K/V converted before the dot: 64-key tiles three deep; heads of 64: see choose_config).
LONG_KV_KEYS = 4096
# Shared memory a decode tile's K/V stages may take (H200: 227 KB per block; Q and scratch need the rest).
DECODE_SMEM_BUDGET = 192 * 1024
PACK_MAX_ROWS = 128  # pack the query heads of a group while (queries x group) rows fit one tile


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows per tile: query tokens x packed heads
    block_n: int  # keys per tile
    g_pack: int  # query heads of one KV group in a tile (1 or the whole group)
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False  # K/V through Hopper tensor descriptors (only where _use_tma allows)


PAGED_TMA_MIN_PAGE = 64  # pages of 64+ rows load through TMA with 64-key tiles; smaller ones gather rows


@functools.lru_cache(maxsize=1024)
def choose_config(*, head_dim: int, group: int, max_seqlen_q: int, causal: bool, interpreted: bool,
                  tma: bool, page_size: int = 0, wide: bool = False, long_kv: bool = False,
                  kv_itemsize: int = 0, fp8_cvt: bool = False) -> LaunchConfig:
    """Tile shape for a launch, and whether K/V load through TMA descriptors.

    ``tma``: whether the inputs allow descriptors (:func:`use_tma`). ``page_size``: 0 for contiguous
    K/V; pages of ``PAGED_TMA_MIN_PAGE`` rows or more hold whole 64-key tiles and load through one
    descriptor over the pool, smaller ones gather rows through pointers. ``wide``: the grid has a
    program per SM before any KV split (many sequences or long query chunks). ``long_kv``: a
    program streams ``LONG_KV_KEYS`` keys or more (the cache length over the split count);
    ``kv_itemsize``: the K/V element size, which bounds the pipeline depth of long decode tiles
    (0: unknown, no long tiles); ``fp8_cvt``: one-byte K/V whose V tiles the kernel converts before
    their move into the dot's operand layout (``FP8_CVT``), which over gathered pages take 64-key
    tiles (at head dim 64 over pages of 16+ rows: 128-key tiles two deep).

    Decode-like launches (few query rows) pack the KV group's query heads into the rows of one tile;
    prefill launches tile query tokens of one head. The GPU values were measured with
    ``python -m pagedflash bench tune`` on an H200 (docs/performance.md). Where ptxas (triton 3.6)
    crashed on a combination (TMA with packed tiles of 64+ rows or heads under 64 wide, pipelined
    packed pointer tiles of 64+ rows, any pipelined tile over 128 wide) the table steers
    around it; a crash it misses costs one retry with a safe tile (attention.py)."""
    pack = max_seqlen_q * group <= PACK_MAX_ROWS
    g_pack = group if pack else 1
    block_m = max(16, next_pow2(max_seqlen_q * group)) if pack else 128
    block_d = next_pow2(head_dim)
    tma = tma and 64 <= block_d <= 128
    if page_size and (page_size < PAGED_TMA_MIN_PAGE or page_size % 64):
        tma = False  # a 64-key tile must not cross a page
    if interpreted:  # small tiles: fast on the CPU, and every loop stage is exercised
        return LaunchConfig(block_m=block_m if pack else 16, block_n=16, g_pack=g_pack, tma=tma)
    if pack:  # memory-bound: enough K/V bytes in flight per SM
        if block_m > 32:
            # short chunks x group (speculative verification): ptxas crashed on each pipelined tile tried
            return LaunchConfig(block_m=block_m, block_n=32, g_pack=g_pack, num_warps=4, num_stages=1)
        if block_d > 128:
            return LaunchConfig(block_m=block_m, block_n=32, g_pack=g_pack, num_warps=4, num_stages=2)
        if (head_dim == 64 and max_seqlen_q == 1 and block_m == 16 and page_size >= 16
                and (kv_itemsize == 2 or fp8_cvt)):
            # single-token decode of heads of 64 over pages of 16+ rows: fp8 (converted) 128-key tiles
            # two deep; 16-bit 64 keys three deep, four in wide grids (there 1-3 % slower than three deep
            # on most sizes, 8-12 % faster at 1024+ programs). At each tile's best split count within
            # 1.00-1.06x of the best of five tiles on 38 sizes (B 1-256, N 1K-64K, groups 1-8; v28)
            if kv_itemsize == 1:
                return LaunchConfig(block_m=block_m, block_n=128, g_pack=g_pack, num_warps=4, num_stages=2)
            return LaunchConfig(block_m=block_m, block_n=64, g_pack=g_pack, num_warps=4, num_stages=4 if wide else 3)
        # stages of 128-key K and V tiles (padded to block_d) that fit shared memory
        stages_fit = DECODE_SMEM_BUDGET // (2 * 128 * block_d * kv_itemsize) if kv_itemsize else 0
        if wide:  # the grid fills the GPU unsplit
            if long_kv and stages_fit >= 2:  # long programs: 128-key tiles two deep, one-byte K/V three (v14, v21)
                deep = 3 if kv_itemsize == 1 and stages_fit >= 3 else 2
                return LaunchConfig(block_m=block_m, block_n=128, g_pack=g_pack, num_warps=4, num_stages=deep)
            if tma and page_size:  # pages of 64+ rows: 64-key tiles through one descriptor over the pool (v6)
                return LaunchConfig(block_m=block_m, block_n=64, g_pack=g_pack, num_warps=4, num_stages=2,
                                    tma=True)
            # short programs: pointer tiles 4 deep, not TMA (performance.md, v13)
            return LaunchConfig(block_m=block_m, block_n=32, g_pack=g_pack, num_warps=4, num_stages=4)
        if page_size >= PAGED_TMA_MIN_PAGE:  # split grids over 64-row pages: pointer tiles (performance.md, v14)
            return LaunchConfig(block_m=block_m, block_n=64, g_pack=g_pack, num_warps=4, num_stages=3)
        if page_size and fp8_cvt:  # converted one-byte rows gathered from small pages: 64-key tiles three
            # deep, four programs an SM with the converted V tile (1.07-1.17x 128-key tiles, v26)
            return LaunchConfig(block_m=block_m, block_n=64, g_pack=g_pack, num_warps=4, num_stages=3)
        if page_size and stages_fit >= 2:  # rows gathered from small pages: long tiles, two deep (v14)
            return LaunchConfig(block_m=block_m, block_n=128, g_pack=g_pack, num_warps=4, num_stages=2)
        if long_kv and stages_fit >= 3:  # one long split per SM: 128-key tiles three deep (v14)
            return LaunchConfig(block_m=block_m, block_n=128, g_pack=g_pack, num_warps=4, num_stages=3)
        # short splits: pointer tiles 3 deep, not TMA (performance.md, v13)
        return LaunchConfig(block_m=block_m, block_n=64, g_pack=g_pack, num_warps=4, num_stages=3)
    if block_d > 128:
        return LaunchConfig(block_m=64, block_n=32, g_pack=1, num_warps=4, num_stages=1)
    if tma:
        if block_d <= 64 and not page_size:
            return LaunchConfig(block_m=64 if causal else 128, block_n=128, g_pack=1, num_warps=4, num_stages=3,
                                tma=True)
        return LaunchConfig(block_m=64, block_n=64, g_pack=1, num_warps=4, num_stages=3, tma=True)
    if page_size:  # row gather
        if wide:
            return LaunchConfig(block_m=128, block_n=128, g_pack=1, num_warps=8, num_stages=3)
        return LaunchConfig(block_m=64, block_n=64, g_pack=1, num_warps=4, num_stages=3)
    if block_d <= 64:
        return LaunchConfig(block_m=128, block_n=64, g_pack=1, num_warps=8 if causal else 4, num_stages=3)
    return LaunchConfig(block_m=128, block_n=128, g_pack=1, num_warps=8, num_stages=3)


def env_count(name: str, default: int | None, most: int | None = None, least: int = 1, number: type = int):
    """The integer (or other ``number``) from ``least`` (default 1) to ``most`` that environment variable
    ``name`` holds, ``default`` when it is unset or empty, or a clear error naming it."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = number(text)
    except ValueError:
        value = least - 1
    if not (value >= least and (most is None or value <= most)):  # (NaN too)
        bound = f"from {least} to {most}" if most is not None else f"of {least} or more"
        raise ValueError(f"{name}: expected {'an integer' if number is int else 'a number'} {bound}, got {text!r}")
    return value


# Batch-invariant mode (pagedflash.batch_invariance): keys in splits at fixed absolute positions, the
# first INVARIANT_HEAD_KEYS keys of a row in splits of INVARIANT_HEAD_SPLIT_KEYS, the rest in splits of
# INVARIANT_SPLIT_KEYS, each split's state merged left to right (SplitRule). Short splits at the head
# give a short row's decode several programs (at batch 1 a 1K row is otherwise one program streaming
# 16 tiles); long ones past it keep a long row's loop pipelined (each split restarts it). Each split
# is a fold in prefill, and a partial the combine folds in decode: 512-key head splits cost a 1K row's
# batch-1 decode less than 256's folds cost prefill and long rows (docs/performance.md v62). A split's
# partial state is kept in fp32 ([splits, tokens, Hq, D]) until the combine. Any rule of multiples of
# the invariant tile's key count gives invariant results; outputs under different rules differ.
INVARIANT_SPLIT_KEYS = env_count("PAGEDFLASH_INVARIANT_SPLIT_KEYS", 2048)
INVARIANT_HEAD_KEYS = env_count("PAGEDFLASH_INVARIANT_HEAD_KEYS", 4096, least=0)
INVARIANT_HEAD_SPLIT_KEYS = env_count("PAGEDFLASH_INVARIANT_HEAD_SPLIT_KEYS", 512)
# A middle tier (opt-in, none by default): the keys past the head up to INVARIANT_MID_KEYS (an
# absolute position; 0: no middle tier) in splits of INVARIANT_MID_SPLIT_KEYS, so that rows long
# enough to pass the head but not that position get more, shorter splits than the rest.
INVARIANT_MID_KEYS = env_count("PAGEDFLASH_INVARIANT_MID_KEYS", 0, least=0)
INVARIANT_MID_SPLIT_KEYS = env_count("PAGEDFLASH_INVARIANT_MID_SPLIT_KEYS", 1024)
# the interpreter: 16-key tiles; four one-tile splits, then two tiles a split, so tests cross both
INTERPRET_SPLIT_RULE = (32, 64, 16)
MAX_GRID_SPLITS = 65535  # a CUDA grid's third dimension (programs sharing a row's splits)


# Which programs compute the mode's splits (never where they start: any choice gives the same bits).
# A launch keeps one partial state a split of its longest row while that count is at most
# INVARIANT_MAX_SPLITS and its fp32 partials, (split x query row x query head) states of D + 1 values,
# number at most INVARIANT_SPLIT_STATES (None: no limit), its programs sharing a row's splits
# (invariant_split_programs); else, or where that leaves one program a row, one program folds a row's
# splits. The budget bounds the partials' memory (a decode graph is sized for the model's longest row).
# Defaults: 512 splits (the default rule's 1,036,288 keys, fewer with a middle tier: 1,007,616 with
# PAGEDFLASH_INVARIANT_MID_KEYS=32768; the programs do not grow with them), no budget.
INVARIANT_MAX_SPLITS_DEFAULT = 512
INVARIANT_MAX_SPLITS = env_count("PAGEDFLASH_INVARIANT_MAX_SPLITS", INVARIANT_MAX_SPLITS_DEFAULT, MAX_GRID_SPLITS)
INVARIANT_SPLIT_STATES = env_count("PAGEDFLASH_INVARIANT_SPLIT_STATES", None)
# Programs an SM a split launch aims at (invariant_split_programs): its programs share a row's splits.
# 7 keeps a few long rows' splits spread over the SMs, and enough programs in flight over gathered pages
# to hide their block-table reads, without a second round of one-warp decode programs at 128 row-heads
# (docs/performance.md v47 measures 2, 4 and 8 contiguous, v51 8 over pages, v53 7 against 8).
INVARIANT_SPLIT_WAVES = env_count("PAGEDFLASH_INVARIANT_SPLIT_WAVES", 7)
# Split partials the mode's combine loads at once before folding them in order (combine._combine_kernel):
# 1 (the default) loads each split's one ahead of its fold, so a row of S splits waits on S round trips
# in a row; LOADS > 1 waits on ceil(S / LOADS) of them, for more registers and instructions (the same
# bits: one fold order). Opt-in until measured (docs/performance.md v58).
INVARIANT_COMBINE_LOADS = env_count("PAGEDFLASH_INVARIANT_COMBINE_LOADS", 1, most=32)
# The GPU tile of the mode, rows:keys:warps:stages (invariant_config); empty: _invariant_tile's default
# (64:64:4 with as many stages as shared memory holds; docs/performance.md v36 measures five tiles).
# Another value is the tuning lever (every launch of a process takes the same one, so results stay
# invariant; they differ between values).
INVARIANT_TILE = os.environ.get("PAGEDFLASH_INVARIANT_TILE", "")
# The mode's rows:warps:stages for calls with more than one query row a sequence (prefill, chunked prefill);
# empty: the tile above for every call. Its keys stay the tile's (the softmax folds the same key tiles in
# the same order), only the number of rows sharing a tile changes: on sm90 a wgmma computes each element
# from its row alone (64 rows a warpgroup) and a row's reductions stay inside its warp, so a row's bits
# do not change (the invariance tests pass with 128:8:3 on an H100). On a GPU it must keep the tile's rows
# a warp and its MMA (warps a multiple of 4 with it). Opt-in: 128:8:3 runs slower than the default tile.
INVARIANT_PREFILL_TILE = os.environ.get("PAGEDFLASH_INVARIANT_PREFILL_TILE", "")
# The mode's rows:warps:stages on NVIDIA GPUs for calls with one query row a sequence (decode) of 16-bit q
# over 16-bit K/V, or over fp8 K/V where the GPU converts them by instruction (sm_89+), at least
# INVARIANT_DECODE_WAVES (fp8: INVARIANT_DECODE_WAVES_FP8; a launch that splits: INVARIANT_DECODE_WAVES_SPLIT)
# programs (sequences x KV heads) an SM and a KV group that divides its rows;
# empty: the tile above for every call. Its keys and its rows a warp stay the tile's, its stages at most
# the tile's; its MMA may differ (16:1, one warp's MMA, where the tile's four warps issue a warpgroup's):
# that both give a row the same bits is what the compiled invariance tests check
# (test_rows_equal_with_a_decode_tile). A decode row fills a KV group's rows of a tile: 16 rows do a
# quarter of the 64-row tile's softmax work, which pays where many programs share the SMs and costs where
# a few stream long rows (one warp keeps too few loads in flight; docs/performance.md v48).
INVARIANT_DECODE_TILE_DEFAULT = "16:1:2"  # (left unused, not refused, under a tile of other rows a warp)
INVARIANT_DECODE_TILE = os.environ.get("PAGEDFLASH_INVARIANT_DECODE_TILE", INVARIANT_DECODE_TILE_DEFAULT)
INVARIANT_DECODE_WAVES = env_count("PAGEDFLASH_INVARIANT_DECODE_WAVES", 8, least=0)
# The same for decode launches that split a row's keys (several programs a row-head, so a launch of
# sequences x KV heads under INVARIANT_DECODE_WAVES may still fill the SMs with one-warp programs), 16-bit
# K/V only: from one wave (docs/performance.md v57; a fraction of a wave may be given, as for fp8).
INVARIANT_DECODE_WAVES_SPLIT = env_count("PAGEDFLASH_INVARIANT_DECODE_WAVES_SPLIT", 1, least=0, number=float)
# The same over fp8 K/V (on GPUs with the fp8 conversion instruction): from half a wave of programs, where the
# 64-row tile's softmax and conversions, not its bytes, bound it (docs/performance.md v51).
INVARIANT_DECODE_WAVES_FP8 = env_count("PAGEDFLASH_INVARIANT_DECODE_WAVES_FP8", 0.5, least=0, number=float)


BIG_SHARED_MEMORY = ((8, 0), (8, 7), (9, 0), (10, 0))  # 164-227 KB a block; sm86/89/120: ~99 KB


def _invariant_tile(head_dim: int, capability: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """:data:`INVARIANT_TILE` as (rows, keys, warps, stages), or a clear error; unset: the default for
    ``head_dim`` and the GPU: 64 rows, 64 keys, 4 warps, and as many stages of K and V as shared
    memory holds (3 up to D = 128 on the GPUs of :data:`BIG_SHARED_MEMORY`, else one fewer; stages
    do not change the arithmetic, only the tile does)."""
    if not INVARIANT_TILE:
        stages = (3 if head_dim <= 128 else 2) - (capability not in BIG_SHARED_MEMORY)
        return 64, 64, 4, stages
    try:
        rows, keys, warps, stages = (int(x) for x in INVARIANT_TILE.split(":"))
    except ValueError:
        rows = keys = warps = stages = 0
    if not (rows >= 16 and keys >= 16 and warps >= 1 and stages >= 1
            and all(n & (n - 1) == 0 for n in (rows, keys, warps))):
        raise ValueError(f"PAGEDFLASH_INVARIANT_TILE: expected rows:keys:warps:stages (rows and keys powers of two "
                         f">= 16, warps a power of two, stages >= 1), got {INVARIANT_TILE!r}")
    return rows, keys, warps, stages


def _rows_warps_stages(name: str, text: str) -> tuple[int, int, int]:
    """Variable ``name``'s value ``text`` as (rows, warps, stages), or a clear error."""
    try:
        rows, warps, stages = (int(x) for x in text.split(":"))
    except ValueError:
        rows = warps = stages = 0
    if not (rows >= 16 and warps >= 1 and stages >= 1 and all(n & (n - 1) == 0 for n in (rows, warps))):
        raise ValueError(f"{name}: expected rows:warps:stages (rows a power of two >= 16, warps a power of two, "
                         f"stages >= 1), got {text!r}")
    return rows, warps, stages


@dataclass(frozen=True)
class SplitRule:
    """The batch-invariant mode's splits of a row's keys, at absolute positions: ``head_keys`` keys
    in splits of ``head_split``, then up to key ``mid_keys`` splits of ``mid_split`` (none where
    ``mid_keys`` is at most ``head_keys``), then splits of ``keys`` (``head_keys`` 0: no head)."""

    keys: int
    head_keys: int = 0
    head_split: int = 1
    mid_keys: int = 0
    mid_split: int = 1

    @property
    def mid_end(self) -> int:
        """Where the splits of ``keys`` begin."""
        return max(self.mid_keys, self.head_keys)

    def _tiers(self) -> tuple[int, int]:
        """Splits of the head, and of the head and the middle tier."""
        head = self.head_keys // self.head_split
        return head, head + (self.mid_end - self.head_keys) // self.mid_split

    def count(self, n: int) -> int:
        """Splits holding keys ``[0, n)`` (at least one)."""
        head = min(n, self.head_keys)
        mid = min(max(n - self.head_keys, 0), self.mid_end - self.head_keys)
        return max(1, cdiv(head, self.head_split) + cdiv(mid, self.mid_split)
                   + cdiv(max(n - self.mid_end, 0), self.keys))

    def start(self, s: int) -> int:
        """The first key of split ``s`` (the kernels' ``split_start``)."""
        head, before_tail = self._tiers()
        if s < head:
            return s * self.head_split
        if s < before_tail:
            return self.head_keys + (s - head) * self.mid_split
        return self.mid_end + (s - before_tail) * self.keys


def invariant_split_rule(interpreted: bool, head_dim: int) -> SplitRule:
    """The batch-invariant mode's :class:`SplitRule` (every size a multiple of the invariant tile's
    keys, the head a whole number of its splits), or a clear error naming the variable."""
    keys, head_keys, head_split, *mid = INTERPRET_SPLIT_RULE if interpreted else (
        INVARIANT_SPLIT_KEYS, INVARIANT_HEAD_KEYS, INVARIANT_HEAD_SPLIT_KEYS, INVARIANT_MID_KEYS,
        INVARIANT_MID_SPLIT_KEYS)
    mid_keys, mid_split = mid or (0, 1)
    block_n = invariant_config(group=1, head_dim=head_dim, capability=None, interpreted=interpreted).block_n
    if keys <= 0 or keys % block_n:
        raise ValueError(f"PAGEDFLASH_INVARIANT_SPLIT_KEYS: expected a positive multiple of {block_n}, got {keys}")
    if head_keys == 0:  # no head: its split size is unused
        head_split = keys
    elif head_split <= 0 or head_split % block_n:
        raise ValueError(f"PAGEDFLASH_INVARIANT_HEAD_SPLIT_KEYS: expected a positive multiple of {block_n}, "
                         f"got {head_split}")
    elif head_keys < 0 or head_keys % head_split:
        raise ValueError(f"PAGEDFLASH_INVARIANT_HEAD_KEYS: expected 0 or a positive multiple of "
                         f"PAGEDFLASH_INVARIANT_HEAD_SPLIT_KEYS ({head_split}), got {head_keys}")
    if mid_keys == 0:  # no middle tier: its split size is unused
        return SplitRule(keys, head_keys, head_split)
    if mid_split <= 0 or mid_split % block_n:
        raise ValueError(f"PAGEDFLASH_INVARIANT_MID_SPLIT_KEYS: expected a positive multiple of {block_n}, "
                         f"got {mid_split}")
    if mid_keys <= head_keys or (mid_keys - head_keys) % mid_split:
        raise ValueError(f"PAGEDFLASH_INVARIANT_MID_KEYS: expected 0 or PAGEDFLASH_INVARIANT_HEAD_KEYS ({head_keys}) "
                         f"plus a positive multiple of PAGEDFLASH_INVARIANT_MID_SPLIT_KEYS ({mid_split}), got {mid_keys}")
    return SplitRule(keys, head_keys, head_split, mid_keys, mid_split)


def invariant_num_splits(max_seqlen_k: int, rule: SplitRule, states_per_split: int) -> int:
    """The batch-invariant mode's split count when a launch splits at all: the splits of the longest
    row's keys under ``rule``, or none (1) past :data:`INVARIANT_MAX_SPLITS` splits or past
    :data:`INVARIANT_SPLIT_STATES` partial states (``states_per_split``: the launch's query rows x
    query heads). Any other count would merge the partials in another order."""
    splits = rule.count(max(max_seqlen_k, 1))
    within = INVARIANT_SPLIT_STATES is None or splits * states_per_split <= INVARIANT_SPLIT_STATES
    return splits if splits <= INVARIANT_MAX_SPLITS and within else 1


def invariant_split_programs(num_splits: int, programs: int, sms: int) -> int:
    """Programs a row's ``num_splits`` splits share in a batch-invariant split launch (each computes
    every P-th split; no bit depends on P): about :data:`INVARIANT_SPLIT_WAVES` programs on each of
    ``sms`` SMs over the launch's ``programs`` (rows x KV heads), at most one a split. Fewer programs
    than splits keep a graph sized for a long model length from launching one program per split of
    it at small batch (those past a short row's splits would do nothing). 1: the launch
    does not split (one program folds a row's splits: no partials, no combine)."""
    return max(1, min(num_splits, cdiv(INVARIANT_SPLIT_WAVES * sms, max(programs, 1))))


def invariant_config(*, group: int, head_dim: int, capability: tuple[int, int] | None,
                     interpreted: bool, prefill: bool = False, decode_programs: int = 0,
                     sms: int = 0, fp8: bool = False, split: bool = False) -> LaunchConfig:
    """The tile of a launch in batch-invariant mode: a row's scores and its softmax sums are reduced
    by the same operations in the same order under one key tile and one layout of a row's elements
    in its warp (16 rows a warp: the MMA's accumulator layout, whether a warp's MMA or a warpgroup's
    issues it); the prefill and decode tiles keep both, and so a row's bits.
    The query heads of a KV group are packed into the rows when they divide the tile (decode reads
    each K/V byte once per group). By default 64 rows, 64-key tiles, 4 warps, 3 stages on an H200
    up to D = 128 (:func:`_invariant_tile`); in the mode a tile that does not compile is an error,
    never a fallback to another. The keys and the rows a warp depend only on the model's head size
    and the GPU's ``capability``, never on the lengths, the batch or the GPU's size;
    ``PAGEDFLASH_INVARIANT_TILE`` sets another GPU tile (:data:`INVARIANT_TILE`).

    ``prefill`` (more than one query row a sequence): the rows, warps and stages of
    :data:`INVARIANT_PREFILL_TILE` where it is set (stages at most the tile's; the MMA kind kept
    too), the same keys (under the interpreter its rows only). ``decode_programs`` (a decode launch's
    sequences x KV heads, 16-bit or ``fp8`` K/V under 16-bit queries, fp8 only where the GPU converts it
    by instruction, which the caller checks; 0 otherwise) of at least :data:`INVARIANT_DECODE_WAVES`
    (``fp8``: :data:`INVARIANT_DECODE_WAVES_FP8`; a launch that ``split`` s a row's keys, 16-bit:
    :data:`INVARIANT_DECODE_WAVES_SPLIT`) x ``sms`` on an NVIDIA GPU: the rows, warps and stages
    (at most the tile's) of :data:`INVARIANT_DECODE_TILE`, where a KV group divides its rows; a decode
    tile set to other rows a warp than the tile's is refused on every call that does not take the prefill tile, whether it
    would take the decode tile or not (the default one is left unused). Which of these runs a row
    never changes its bits, only its speed."""
    rows, keys, warps, stages = (16, 16, 4, 1) if interpreted else _invariant_tile(head_dim, capability)
    if prefill and INVARIANT_PREFILL_TILE:
        prefill_rows, prefill_warps, prefill_stages = _rows_warps_stages("PAGEDFLASH_INVARIANT_PREFILL_TILE",
                                                                         INVARIANT_PREFILL_TILE)
        if not interpreted:
            if prefill_rows * warps != rows * prefill_warps or (prefill_warps % 4 == 0) != (warps % 4 == 0):
                raise ValueError(f"PAGEDFLASH_INVARIANT_PREFILL_TILE: expected the mode's tile's {rows // warps} rows a "
                                 f"warp and its MMA (warps a multiple of 4 as its {warps}, or not), got "
                                 f"{INVARIANT_PREFILL_TILE!r}")
            warps, stages = prefill_warps, min(prefill_stages, stages)  # no more stages than the tile holds
        rows = prefill_rows
    elif not prefill and INVARIANT_DECODE_TILE and not interpreted and capability is not None:
        decode_rows, decode_warps, decode_stages = _rows_warps_stages("PAGEDFLASH_INVARIANT_DECODE_TILE",
                                                                      INVARIANT_DECODE_TILE)
        keeps_layout = decode_rows * warps == rows * decode_warps
        if not keeps_layout and INVARIANT_DECODE_TILE != INVARIANT_DECODE_TILE_DEFAULT:
            raise ValueError(f"PAGEDFLASH_INVARIANT_DECODE_TILE: expected the mode's tile's {rows // warps} rows "
                             f"a warp, got {INVARIANT_DECODE_TILE!r}")
        waves = INVARIANT_DECODE_WAVES_FP8 if fp8 else INVARIANT_DECODE_WAVES_SPLIT if split else INVARIANT_DECODE_WAVES
        if (keeps_layout and decode_programs > 0 and decode_programs >= waves * sms
                and decode_rows % group == 0):
            rows, warps, stages = decode_rows, decode_warps, min(decode_stages, stages)
    g_pack = group if rows % group == 0 else 1
    return LaunchConfig(block_m=rows, block_n=keys, g_pack=g_pack, num_warps=warps, num_stages=stages)


def choose_num_splits(*, programs: int, max_seqlen_k: int, block_n: int, kv_bytes_per_key: int,
                      decode: bool, page_size: int, device: torch.device) -> int:
    """Split the KV range when the grid would leave SMs idle. ``kv_bytes_per_key``: K+V bytes one
    program reads per key (2 x head dim x element size).

    Decode (packed query rows: its programs only stream K/V): ``KV_BYTES_PER_SM`` per key step on
    every SM (whole programs, rounded down so no SM gets one more than the rest); twice that over
    pages whose rows are gathered (under ``PAGED_TMA_MIN_PAGE`` rows), and over larger pages once a
    split would stream ``LONG_KV_KEYS`` keys or more (gathered pages only while the doubled splits
    keep two tiles each); at most one split per KV tile. ``page_size``: 0 for a contiguous cache.
    Prefill tiles: about two programs per SM, rounded up, at least two tiles per split. Uses only
    host-known sizes (the cache capacity or ``max_seqlen_k``), never device data, so it is free and
    graph-safe."""
    sms = num_sms(device)
    kv_tiles = cdiv(max(max_seqlen_k, 1), block_n)
    if not decode:
        splits = cdiv(2 * sms, programs) if programs < sms else 1
        return max(1, min(splits, kv_tiles // 2, MAX_SPLITS))
    slots = sms * max(1, KV_BYTES_PER_SM // kv_bytes_per_key)
    long = cdiv(max_seqlen_k, max(slots // programs, 1)) >= LONG_KV_KEYS
    # doubled splits over gathered pages must keep two tiles each (one tile a split is slower:
    # docs/performance.md, v15, "Paged split counts")
    short = cdiv(max_seqlen_k, max(min(2 * slots // programs, MAX_SPLITS), 1)) < 2 * block_n
    if page_size and ((page_size < PAGED_TMA_MIN_PAGE and not short) or long):
        slots *= 2  # block-table reads sit on the load path; more programs in flight hide them (v14)
    return max(1, min(slots // programs, kv_tiles, MAX_SPLITS))


def tma_device(device: torch.device) -> bool:
    """Whether ``device`` loads through Hopper tensor descriptors: an NVIDIA GPU of compute capability
    9.0 or newer. AMD GPUs never (ROCm reports 9.x for an MI300, which has no TMA)."""
    capability = nvidia_capability(device)
    return capability is not None and capability >= (9, 0)


def use_tma(k: torch.Tensor, v: torch.Tensor, paged: bool) -> bool:
    """Whether K/V may load through tensor descriptors: a :func:`tma_device`, fp16/bf16 (fp8 with
    ``TMA_FP8``), 16-byte aligned bases and row strides; for a page pool also rows that follow each
    other across pages (one descriptor over ``[num_blocks * page_size, D]``, rows addressable by
    int32). The tile must then fit a page, which the caller checks against its block size."""
    if not TMA or k.dtype not in (torch.float16, torch.bfloat16, *(FP8_DTYPES if TMA_FP8 else ())):
        return False
    if not (INTERPRET_TMA if interpreted() else tma_device(k.device)):
        return False
    if not (descriptor_aligned(k) and descriptor_aligned(v)):
        return False
    if paged:
        return all(t.stride(0) == t.shape[1] * t.stride(1) for t in (k, v)) and k.shape[0] * k.shape[1] < 2**31
    return True

"""The launch table's invariants (the values themselves are measured: docs/performance.md), and the
device test behind the Hopper descriptor path."""

import itertools

import pytest
import torch

from pagedflash.ops import launch, utils
from pagedflash.ops.launch import (
    DECODE_SMEM_BUDGET,
    MAX_SPLITS,
    PACK_MAX_ROWS,
    PAGED_TMA_MIN_PAGE,
    choose_config,
    choose_num_splits,
)
from pagedflash.ops.utils import next_pow2

HEAD_DIMS = [16, 40, 64, 80, 96, 128, 160, 256]
GROUPS = [1, 2, 4, 8]
Q_LENS = [1, 2, 5, 16, 33, 300, 8192]
PAGES = [0, 1, 5, 16, 32, 64, 80, 128, 256]
ITEMSIZES = [0, 1, 2, 4]  # 0: unknown; 1: fp8


def _all(interpreted):
    for d, g, sq, causal, tma, page, wide, long_kv, itemsize in itertools.product(
            HEAD_DIMS, GROUPS, Q_LENS, [False, True], [False, True], PAGES, [False, True], [False, True], ITEMSIZES):
        yield (d, g, sq, page, itemsize), choose_config(
            head_dim=d, group=g, max_seqlen_q=sq, causal=causal, interpreted=interpreted, tma=tma, page_size=page,
            wide=wide, long_kv=long_kv, kv_itemsize=itemsize, fp8_cvt=itemsize == 1)


@pytest.mark.parametrize("interpreted", [False, True], ids=["gpu_table", "interpreter"])
def test_table_invariants(interpreted):
    for (d, g, sq, page, itemsize), cfg in _all(interpreted):
        where = f"D={d} G={g} Sq={sq} page={page}: {cfg}"
        packed = sq * g <= PACK_MAX_ROWS
        assert cfg.g_pack == (g if packed else 1), where
        assert cfg.block_m % cfg.g_pack == 0 and cfg.block_m >= 16, where
        if packed:  # one tile holds every query row of the group
            assert cfg.block_m // cfg.g_pack >= sq, where
        if cfg.tma:
            assert 64 <= next_pow2(d) <= 128, where  # ptxas (triton 3.6) crashed on other tile widths
            if page:  # a descriptor tile never crosses a page
                assert page >= PAGED_TMA_MIN_PAGE and page % cfg.block_n == 0, where
        if not interpreted and next_pow2(d) > 128:
            assert cfg.num_stages <= 2, where
        if not interpreted and packed and cfg.block_m > 32:
            assert cfg.num_stages == 1 and not cfg.tma, where
        if not interpreted and packed:  # decode tiles: their K/V stages (padded to a power of two) fit
            stage = 2 * cfg.block_n * next_pow2(d) * (itemsize or 4)  # an unknown size: as for fp32
            assert cfg.num_stages * stage <= DECODE_SMEM_BUDGET, where


def test_heads_of_64_over_pages():
    """Single-token decode of 64-wide heads over pages of 16+ rows takes its own tiles
    (docs/performance.md v28); 128-wide heads, smaller pages and the contiguous cache keep theirs."""
    def pick(d=64, page=16, itemsize=2, wide=True, long_kv=True, sq=1, cvt=None):
        cfg = choose_config(head_dim=d, group=4, max_seqlen_q=sq, causal=True, interpreted=False, tma=True,
                            page_size=page, wide=wide, long_kv=long_kv, kv_itemsize=itemsize,
                            fp8_cvt=itemsize == 1 if cvt is None else cvt)
        return cfg.block_n, cfg.num_stages, cfg.tma

    for page in (16, 32, 64, 256):
        for long_kv in (False, True):
            assert pick(page=page, long_kv=long_kv, wide=False) == (64, 3, False)
            assert pick(page=page, long_kv=long_kv, wide=True) == (64, 4, False)
            for wide in (False, True):
                assert pick(page=page, long_kv=long_kv, wide=wide, itemsize=1) == (128, 2, False)
    # the rest keep the table's rows: 128-wide heads, other head dims padded to 64, single-row pages,
    # the contiguous cache, speculative rows, fp32 caches, fp8 without the conversion
    assert pick(d=128) == (128, 2, False) and pick(d=128, itemsize=1) == (128, 3, False)
    assert pick(d=48) == pick(page=1) == pick(page=8) == pick(page=15) == pick(itemsize=4) == (128, 2, False)
    assert pick(sq=2) == pick(sq=8) == (128, 2, False)  # speculative rows (2 x 4 heads: still 16 packed rows)
    assert pick(page=0) == (128, 2, False) and pick(page=0, long_kv=False) == (32, 4, False)
    assert pick(itemsize=1, cvt=False) == (128, 3, False)


def test_split_count_rule():
    cpu = torch.device("cpu")  # a nominal 16 SMs

    def pick(programs, n, bytes_per_key=512, page=0, decode=True):
        return choose_num_splits(programs=programs, max_seqlen_k=n, block_n=64, kv_bytes_per_key=bytes_per_key,
                                 decode=decode, page_size=page, device=cpu)

    assert pick(8, 4096) == 2  # one program per SM for 512 K+V bytes per key (a 128-wide bf16 head)
    assert pick(8, 4096, bytes_per_key=256) == 4  # two per SM for a 64-wide head
    assert pick(5, 4096) == 3  # rounded down: no SM gets one more than the rest
    assert pick(8, 1 << 20) == 2  # long splits stay one per SM over a contiguous cache
    # pages of 64+ rows: as many while a split is short, twice as many once it streams 4K keys or more
    assert pick(8, 4096, page=64) == 2 and pick(8, 8192, page=64) == 4 and pick(5, 1 << 20, page=64) == 6
    assert pick(8, 4096, page=16) == 4 and pick(8, 4096, page=1) == 4  # gathered rows: twice as many
    # ... while the doubled splits keep two key tiles each (16 SMs here: 32 splits of 2K keys would get one)
    assert pick(1, 2048, page=16) == pick(1, 2048) == 16 and pick(1, 8192, page=1) == 32
    assert pick(16, 4096) == 1 and pick(40, 1 << 20) == 1  # the grid fills the SMs already
    assert pick(1, 100) == 2 and pick(1, 100, page=16) == 2  # at most one split per key tile
    # prefill tiles: about two per SM, rounded up, at least two tiles per split
    assert pick(5, 4096, decode=False) == 7 and pick(1, 100, decode=False) == 1
    for programs, n in itertools.product([1, 3, 8, 17, 64, 1000], [0, 1, 63, 64, 65, 5000, 1 << 17]):
        for kind in ({}, {"page": 16}, {"page": 64}, {"decode": False}):
            assert 1 <= pick(programs, n, **kind) <= MAX_SPLITS


class _CudaTensor:
    """What :func:`pagedflash.ops.launch.use_tma` reads of a K/V tensor: a bf16 cache on GPU 0."""

    dtype, device, shape = torch.bfloat16, torch.device("cuda", 0), (2, 64, 8, 128)

    def element_size(self):
        return 2

    def data_ptr(self):
        return 1 << 20

    def stride(self):
        return (65536, 1024, 128, 1)


@pytest.mark.parametrize("hip,capability,tma,cvt", [
    ("6.2.41133", (9, 4), False, False),  # MI300X: ROCm builds of torch call it "cuda" and report gfx942 as 9.4
    ("6.2.41133", (9, 0), False, False),  # MI200-class (gfx90a): 9.0
    (None, (9, 0), True, True),  # H100 / H200
    (None, (10, 0), True, True),  # Blackwell
    (None, (8, 9), False, True),  # Ada
    (None, (8, 0), False, False),  # A100
], ids=["rocm_mi300", "rocm_gfx90a", "sm90", "sm100", "sm89", "sm80"])
def test_hopper_path_only_on_nvidia(monkeypatch, hip, capability, tma, cvt):
    """The descriptor (TMA) path is chosen by an NVIDIA CUDA device of capability 9.0+, the inline-asm
    fp8 conversion by one of 8.9+, never by the major version alone: an AMD GPU reporting 9.x takes
    the portable pointer path and the plain cast."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(launch, "interpreted", lambda: False)  # as compiled on that device
    monkeypatch.setattr(utils, "interpreted", lambda: False)
    monkeypatch.setattr(launch, "TMA", True)
    utils.nvidia_capability.cache_clear()
    try:
        assert utils.nvidia_capability(torch.device("cuda", 0)) == (None if hip else capability)
        assert launch.tma_device(torch.device("cuda", 0)) == tma
        assert launch.use_tma(_CudaTensor(), _CudaTensor(), paged=False) == tma
        assert utils.fp8_cvt_device(torch.device("cuda", 0)) == cvt
        assert not launch.tma_device(torch.device("cpu")) and not utils.fp8_cvt_device(torch.device("cpu"))
    finally:
        utils.nvidia_capability.cache_clear()

"""KV pools and the metadata helpers, on the CPU."""

import math

import pytest
import torch

from pagedflash.cache import (
    PAD_BLOCK_ID,
    BlockManager,
    KVCache,
    block_table_tensor,
    cu_seqlens_tensor,
    seqlens_tensor,
    slot_mapping,
    slot_mapping_tensor,
)

SIZES = dict(num_layers=3, num_blocks=7, page_size=5, num_kv_heads=2, head_dim=24)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=str
)
def test_pool_shapes_and_views(dtype):
    cache = KVCache(**SIZES, dtype=dtype, device="cpu")
    assert len(cache) == 3 and cache.dtype == dtype and cache.device == torch.device("cpu")
    assert cache.kv.shape == (3, 2, 7, 5, 2, 24)
    for layer in range(3):
        k, v = cache[layer]
        assert k.shape == v.shape == (7, 5, 2, 24) and k.dtype == dtype and k.is_contiguous()
        assert (
            k.data_ptr() == cache.k_cache(layer).data_ptr()
            and v.data_ptr() == cache.v_cache(layer).data_ptr()
        )
    assert cache.nbytes == 3 * 2 * 7 * 5 * 2 * 24 * torch.empty((), dtype=dtype).element_size()
    assert cache.nbytes == 7 * KVCache.bytes_per_block(
        **{k: v for k, v in SIZES.items() if k != "num_blocks"}, dtype=dtype
    )


def test_views_are_distinct_and_write_through():
    cache = KVCache(**SIZES, dtype=torch.float32, device="cpu")
    assert not cache.kv.any()
    cache.k_cache(1)[4, 2] = 1.0
    cache.v_cache(2)[0, 0] = 2.0
    assert cache.kv[1, 0, 4, 2].eq(1).all() and cache.kv[2, 1, 0, 0].eq(2).all()
    assert cache.kv.sum() == (1.0 * 2 * 24) + (2.0 * 2 * 24)


def test_poison_fills_nan():
    cache = KVCache(**SIZES, dtype=torch.float16, device="cpu", poison=True)
    assert cache.kv.isnan().all()


@pytest.mark.parametrize("layer", [-1, 3, 1.0], ids=["negative", "too-large", "float"])
def test_bad_layer(layer):
    cache = KVCache(**SIZES, dtype=torch.float16, device="cpu")
    with pytest.raises(IndexError, match=rf"layer must be an int in \[0, 3\), got {layer!r}"):
        cache.k_cache(layer)


@pytest.mark.parametrize("name", list(SIZES))
def test_bad_sizes(name):
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got 0"):
        KVCache(**{**SIZES, name: 0}, dtype=torch.float16, device="cpu")


def test_num_blocks_for_memory():
    sizes = dict(num_layers=2, page_size=16, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    per_block = 2 * 2 * 16 * 4 * 128 * 2
    assert KVCache.bytes_per_block(**sizes) == per_block
    assert KVCache.num_blocks_for_memory(10 * per_block + per_block - 1, **sizes) == 10
    assert KVCache.num_blocks_for_memory(per_block - 1, **sizes) == 0
    with pytest.raises(ValueError, match="num_bytes must be an int >= 0, got -1"):
        KVCache.num_blocks_for_memory(-1, **sizes)


def test_block_table_tensor_pads_with_a_valid_page():
    out = block_table_tensor([[3, 1], [], [4, 0, 6]], device="cpu")
    assert out.dtype == torch.int32 and out.is_contiguous()
    assert out.tolist() == [[3, 1, PAD_BLOCK_ID], [PAD_BLOCK_ID] * 3, [4, 0, 6]]
    assert PAD_BLOCK_ID == 0
    wide = block_table_tensor([[2]], device="cpu", max_blocks=4)
    assert wide.shape == (1, 4) and wide.tolist() == [[2, 0, 0, 0]]
    assert block_table_tensor([], device="cpu").shape == (0, 0)
    with pytest.raises(ValueError, match=r"max_blocks must be at least the longest block table \(3\), got 2"):
        block_table_tensor([[1, 2, 3]], device="cpu", max_blocks=2)


@pytest.mark.parametrize("page_size", [1, 3, 5])
def test_slot_mapping_matches_pool_positions(page_size):
    table = [6, 2, 9, 0]
    slots = slot_mapping(table, 1, 3 * page_size - 1, page_size=page_size)
    for pos, slot in zip(range(1, 3 * page_size - 1), slots):
        assert divmod(slot, page_size) == (table[pos // page_size], pos % page_size)
    assert slot_mapping(table, 2, 2, page_size=page_size) == []
    # A slot addresses the same element as (page, offset) in a pool flattened to [num_blocks * page_size, ...].
    pool = torch.arange(10 * page_size).reshape(10, page_size)
    assert pool.flatten()[slots].tolist() == [
        pool[table[p // page_size], p % page_size].item() for p in range(1, 3 * page_size - 1)
    ]


def test_slot_mapping_errors():
    with pytest.raises(ValueError, match=r"len\(block_table\) \* page_size = 4, got start=0, end=5"):
        slot_mapping([1, 2], 0, 5, page_size=2)
    with pytest.raises(ValueError, match="got start=2, end=1"):
        slot_mapping([1, 2], 2, 1, page_size=2)
    with pytest.raises(ValueError, match="page_size must be an int >= 1, got 0"):
        slot_mapping([1, 2], 0, 1, page_size=0)


def test_slot_mapping_tensor_concatenates_sequences():
    out = slot_mapping_tensor([[4, 1], [2]], [1, 0], [4, 2], page_size=3, device="cpu")
    assert out.dtype == torch.int64 and out.tolist() == [13, 14, 3, 6, 7]
    assert slot_mapping_tensor([], [], [], page_size=3, device="cpu").shape == (0,)
    with pytest.raises(ValueError, match="one entry per sequence, got lengths 2, 1, 2"):
        slot_mapping_tensor([[4, 1], [2]], [1], [4, 2], page_size=3, device="cpu")


def test_seqlens_and_cu_seqlens():
    lens = seqlens_tensor([3, 0, 5], device="cpu")
    assert lens.dtype == torch.int32 and lens.tolist() == [3, 0, 5]
    cu = cu_seqlens_tensor([3, 0, 5], device="cpu")
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 8]
    assert cu_seqlens_tensor([], device="cpu").tolist() == [0]
    assert cu_seqlens_tensor((n for n in (2, 4)), device="cpu").tolist() == [0, 2, 6]  # any iterable
    with pytest.raises(ValueError, match=r"seqlens must be non-negative, got \[2, -1\]"):
        cu_seqlens_tensor([2, -1], device="cpu")


def test_block_manager_tables_drive_the_pool():
    """Prompt K/V written through slot_mapping is read back through the block table, shared prefix included."""
    page_size, num_blocks = 4, 6
    bm = BlockManager(num_blocks, page_size)
    cache = KVCache(
        num_layers=1,
        num_blocks=num_blocks,
        page_size=page_size,
        num_kv_heads=1,
        head_dim=1,
        dtype=torch.float32,
        device="cpu",
        poison=True,
    )
    k = cache.k_cache(0).view(num_blocks * page_size)
    prompts = {"a": [5, 1, 2, 7, 3, 9], "b": [5, 1, 2, 7, 3, 8, 8, 8, 8]}
    for seq_id, prompt in prompts.items():
        table, cached = bm.allocate(seq_id, prompt)
        slots = slot_mapping_tensor([table], [cached], [len(prompt)], page_size=page_size, device="cpu")
        k[slots] = torch.tensor(prompt[cached:], dtype=torch.float32)  # the engine's cache write
        bm.commit(seq_id, len(prompt))  # its K/V are in the pool: its full pages may be hit
    tables = block_table_tensor([bm.block_table(s) for s in prompts], device="cpu")
    for row, prompt in zip(tables.tolist(), prompts.values()):
        pages = cache.k_cache(0)[row[: math.ceil(len(prompt) / page_size)]].flatten()
        assert pages[: len(prompt)].tolist() == prompt
    assert bm.stats.hit_tokens == page_size

"""Paged KV cache: decode through a block table, varlen prefill over cached prefixes, mixed
prefill+decode batches, and slot-mapped cache writes."""

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, cu_seqlens, ids, make_pool, randn

from pagedflash import flash_attn_varlen_func, flash_attn_with_kvcache, write_kv_cache
from pagedflash import reference as ref

PAGE_SIZES = [1, 2, 4, 5, 8, 16, 32, 64, 128, 256] if ON_GPU else [1, 5, 16, 64]


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("num_splits", [1, 4, 0])
def test_paged_decode(dtype, page, num_splits):
    seqlens = [1, page - 1 or 1, page, page + 1, 77]
    hq, hkv, d = 8, 2, 64
    k_cache, v_cache, table = make_pool(seqlens, page, hkv, d, dtype)
    q = randn(len(seqlens), 1, hq, d, dtype=dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                       num_splits=num_splits, return_lse=True)
    ref_out, ref_lse = ref.kvcache_attention_ref(q, k_cache, v_cache, lens, block_table=table)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


@pytest.mark.parametrize("page", [1, 16])
def test_paged_decode_appends_through_the_table(page):
    seqlens = [0, 17, 40]
    k_cache, v_cache, table = make_pool([n + 2 for n in seqlens], page, 2, 32, torch.float32)
    q = randn(3, 2, 4, 32)
    k_new, v_new = randn(3, 2, 2, 32), randn(3, 2, 2, 32)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens,
                                  block_table=table, num_splits=2)
    ref.append_ref(k_ref, v_ref, k_new, v_new, lens, block_table=table)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert_close(out, ref.kvcache_attention_ref(q, k_ref, v_ref, lens + 2, block_table=table)[0], torch.float32)


def test_sequences_sharing_pages():
    page = 16
    seqlens = [70, 50, 33]
    k_cache, v_cache, table = make_pool(seqlens, page, 2, 32, torch.float32, share_first=2)
    q = randn(3, 1, 4, 32)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, lens, block_table=table)[0], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_mixed_prefill_and_decode_batch(dtype, page, num_splits):
    # prefill rows (many new tokens over a cached prefix) and decode rows (one) in one launch
    new = [40, 1, 1, 17, 1, 3]
    cached = [0, 63, 5, 32, 0, 100]
    total = [c + n for c, n in zip(cached, new)]
    hq, hkv, d = 6, 2, 40
    k_cache, v_cache, table = make_pool(total, page, hkv, d, dtype)
    q = randn(sum(new), hq, d, dtype=dtype)
    cq, ck = cu_seqlens(new), cu_seqlens(total)
    out, lse = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(new), max(total), causal=True,
                                      block_table=table, num_splits=num_splits, return_lse=True)
    ref_out, ref_lse = ref.paged_varlen_attention_ref(q, k_cache, v_cache, cq, ck, table, causal=True)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("num_splits,window", [(1, (-1, 0)), (3, (20, 0))])
def test_keys_past_a_range_come_from_their_own_page(page, num_splits, window):
    """A causal query tile's key range can end inside a key tile; keys past that end but inside the
    sequence are still loaded (and masked in the scores), so they must be read from their own page.
    Page 0 of the pool holds NaN and no table points at it: reading it for them would show."""
    new, cached = [40, 7, 33], [50, 3, 0]
    total = [c + n for c, n in zip(cached, new)]
    k_cache, v_cache, table = make_pool(total, page, 2, 32, torch.float32)
    nan_page = torch.full_like(k_cache[:1], float("nan"))
    k_cache, v_cache, table = torch.cat([nan_page, k_cache]), torch.cat([nan_page, v_cache]), table + 1
    q = randn(sum(new), 8, 32)  # 40 queries x 4 heads per KV head: query tiles, not one packed tile
    cq, ck = cu_seqlens(new), cu_seqlens(total)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(new), max(total), window_size=window,
                                 block_table=table, num_splits=num_splits)
    want = ref.paged_varlen_attention_ref(q, k_cache, v_cache, cq, ck, table, window_size=window)[0]
    assert_close(out, want, torch.float32)


def test_hundreds_of_decode_rows():
    n = 300 if ON_GPU else 120
    seqlens = [int(x) for x in torch.randint(1, 40, (n,))]
    k_cache, v_cache, table = make_pool(seqlens, 16, 1, 32, torch.float32)
    q = randn(n, 4, 32)
    cq, ck = cu_seqlens([1] * n), cu_seqlens(seqlens)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, 1, max(seqlens), causal=True, block_table=table)
    assert_close(out, ref.paged_varlen_attention_ref(q, k_cache, v_cache, cq, ck, table, causal=True)[0],
                 torch.float32)


@pytest.mark.skipif(not ON_GPU, reason="long contexts are for the compiled GPU run")
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("b,hkv,n", [(40, 4, 4100), (16, 8, 9000), (16, 8, 16384)],
                         ids=["wide", "long_splits", "long_programs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=ids)
@pytest.mark.parametrize("d", [128, 64])
def test_long_paged_decode(page, b, hkv, n, dtype, d):
    # the long-context launch choices over pages: 128-key tiles in a grid wider than the GPU, split
    # counts doubled for gathered rows and for long splits over 64-row pages; heads of 64 over pages of
    # 16+ rows take their own tiles (ops/launch.py)
    seqlens = [n - 37 * i for i in range(b)]
    k_cache, v_cache, table = make_pool(seqlens, page, hkv, d, dtype, spare=2)
    q = randn(b, 1, 4 * hkv, d, dtype=dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, lens, block_table=table)[0], dtype)


@pytest.mark.parametrize("page", [1, 16])
def test_write_kv_cache_by_slot(page):
    num_blocks, hkv, d = 8, 2, 48
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    t = 6
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:t].long()
    slots[2] = -1  # padding: skipped
    k, v = randn(t, hkv, d), randn(t, hkv, d)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots)
    ref.write_kv_cache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache.nan_to_num(3.0), k_ref.nan_to_num(3.0))
    assert torch.equal(v_cache.nan_to_num(3.0), v_ref.nan_to_num(3.0))


@pytest.mark.skipif(not ON_GPU, reason="a pool past 2^31 elements needs GPU memory")
def test_pool_offsets_past_int32():
    # page ids whose element offset block_id * stride exceeds 2^31
    page, hkv, d = 16, 8, 128
    stride = page * hkv * d
    num_blocks = (2**31 // stride) + 64
    k_cache = torch.zeros((num_blocks, page, hkv, d), dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    seqlens = [40, 33]
    table = torch.tensor([[num_blocks - 1, num_blocks - 5, num_blocks - 9],
                          [num_blocks - 2, num_blocks - 3, num_blocks - 4]], dtype=torch.int32, device=DEVICE)
    slots = torch.cat([table[b, torch.arange(n, device=DEVICE) // page].long() * page
                       + torch.arange(n, device=DEVICE) % page for b, n in enumerate(seqlens)])
    k, v = randn(sum(seqlens), hkv, d, dtype=torch.bfloat16), randn(sum(seqlens), hkv, d, dtype=torch.bfloat16)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    q = randn(2, 1, 32, d, dtype=torch.bfloat16)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, lens, block_table=table)[0], torch.bfloat16)


@pytest.mark.parametrize("page", [0, 16, 64], ids=["contiguous", "page16", "page64"])
def test_caches_as_views_of_one_fused_buffer(page):
    """K and V caches that are halves of one buffer (FlashInfer's ``[num_blocks, 2, page, Hkv, D]``
    pool, or ``[B, S, 2, Hkv, D]``): strided views, written in place and read back correctly
    (over 64-row pages the pool's rows do not follow each other, so no TMA descriptor spans it)."""
    dtype, hq, hkv, d, b = DTYPES[-1], 8, 2, 64, 3
    lens = torch.tensor([0, 37, 70], dtype=torch.int32, device=DEVICE)
    if page:
        k_pool, v_pool, table = make_pool([n + 3 for n in lens.tolist()], page, hkv, d, dtype)
        fused = torch.stack([k_pool, v_pool], dim=1)  # [num_blocks, 2, page, Hkv, D]
        k_cache, v_cache = fused[:, 0], fused[:, 1]
    else:
        table = None
        fused = randn(b, 80, 2, hkv, d, dtype=dtype)  # [B, S, 2, Hkv, D]
        k_cache, v_cache = fused[:, :, 0], fused[:, :, 1]
    assert not k_cache.is_contiguous()
    q = randn(b, 3, hq, d, dtype=dtype)
    k_new, v_new = randn(b, 3, hkv, d, dtype=dtype), randn(b, 3, hkv, d, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    for splits in (1, 0):
        fused_before = fused.clone()
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens,
                                           block_table=table, num_splits=splits, return_lse=True)
        if splits == 1:
            ref.append_ref(k_ref, v_ref, k_new, v_new, lens, block_table=table)
        else:  # the second call rewrote the same slots with the same tokens
            assert torch.equal(fused.nan_to_num(7.0), fused_before.nan_to_num(7.0))
        assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
        assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
        ref_out, ref_lse = ref.kvcache_attention_ref(q, k_ref, v_ref, lens + 3, block_table=table)
        assert_close(out, ref_out, dtype)
        assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


@pytest.mark.parametrize("page", [16, 64])
def test_chunked_prefill_over_a_fused_pool(page):
    """Chunked prefill (query chunks over cached prefixes) through the K and V halves of one fused
    ``[num_blocks, 2, page, Hkv, D]`` pool."""
    dtype, hq, hkv, d = DTYPES[-1], 8, 2, 64
    total, new = [100, 150], [30, 70]
    k_pool, v_pool, table = make_pool(total, page, hkv, d, dtype)
    fused = torch.stack([k_pool, v_pool], dim=1)
    k_cache, v_cache = fused[:, 0], fused[:, 1]
    q = randn(sum(new), hq, d, dtype=dtype)
    cq, ck = cu_seqlens(new), cu_seqlens(total)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(new), max(total), causal=True, block_table=table)
    assert_close(out, ref.paged_varlen_attention_ref(q, k_pool, v_pool, cq, ck, table, causal=True)[0], dtype)

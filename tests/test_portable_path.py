"""Both ways K/V reach the kernel must stay correct: tensor descriptors (TMA: contiguous K/V, and
page pools whose pages hold whole key tiles) and the portable pointer path.

On a Hopper GPU every case runs twice, TMA on and off. On the CPU the interpreter runs the descriptor
path too (``launch.INTERPRET_TMA``), so its addressing and the masking of stale page slots are
checked there; the pointer variant is what the rest of the suite covers, so it is skipped there."""

import pytest
import torch
from conftest import ON_GPU, assert_close, cu_seqlens, randn
from test_paged import make_pool

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from pagedflash import reference as ref
from pagedflash.ops import launch

DTYPE = torch.bfloat16 if ON_GPU else torch.float16


@pytest.fixture(params=[True, False], ids=["tma", "pointers"])
def tma(request, monkeypatch):
    if not ON_GPU and not request.param:
        pytest.skip("the pointer path is the default under the interpreter")
    monkeypatch.setattr(launch, "TMA", request.param)
    monkeypatch.setattr(launch, "INTERPRET_TMA", request.param)
    launch.choose_config.cache_clear()
    yield request.param
    launch.choose_config.cache_clear()


@pytest.mark.parametrize("d", [64, 80, 128, 256] if ON_GPU else [64])
@pytest.mark.parametrize("causal", [False, True])
def test_dense(tma, d, causal):
    sq, sk = (300, 333) if ON_GPU else (37, 45)
    q = randn(2, sq, 8, d, dtype=DTYPE)
    k, v = randn(2, sk, 2, d, dtype=DTYPE), randn(2, sk, 2, d, dtype=DTYPE)
    assert_close(flash_attn_func(q, k, v, causal=causal), ref.attention_ref(q, k, v, causal=causal)[0], DTYPE)


def test_varlen(tma):
    lens = [1, 200, 0, 77, 513] if ON_GPU else [1, 40, 0, 23]
    q = randn(sum(lens), 4, 128, dtype=torch.float16)
    k, v = randn(sum(lens), 4, 128, dtype=torch.float16), randn(sum(lens), 4, 128, dtype=torch.float16)
    cu = cu_seqlens(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, window_size=(100, 0))
    want = ref.varlen_attention_ref(q, k, v, cu, cu, causal=True, window_size=(100, 0))[0]
    assert_close(out, want, torch.float16)


@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode(tma, num_splits):
    n, cut = (999, 517) if ON_GPU else (99, 51)
    q = randn(3, 1, 32, 128, dtype=DTYPE)
    k_cache, v_cache = randn(3, n, 8, 128, dtype=DTYPE), randn(3, n, 8, 128, dtype=DTYPE)
    lens = torch.tensor([n, 0, cut], dtype=torch.int32, device=q.device)
    k_cache[2, cut:] = float("nan")  # past the length: must never be read
    v_cache[2, cut:] = float("nan")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=num_splits)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, lens)[0], DTYPE)


# Pages of 64+ rows hold whole key tiles, so they load through one descriptor over the pool; the
# pool is NaN outside the slots in use, so a stale slot of a sequence's last page that reached the
# output would show.
@pytest.mark.parametrize("page", [64, 128, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode(tma, page, num_splits):
    seqlens = [1, page - 1, page, page + 1, 3 * page + 5]
    k_cache, v_cache, table = make_pool(seqlens, page, 2, 64, DTYPE)
    q = randn(len(seqlens), 2, 8, 64, dtype=DTYPE)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=q.device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, num_splits=num_splits)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, lens, block_table=table)[0], DTYPE)


@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("window", [(-1, 0), (30, 0), (-1, -1)])
def test_paged_varlen(tma, page, window):
    new = [70, 1, 33, 1] if ON_GPU else [20, 1, 9, 1]
    cached = [0, 2 * page - 1, page + 7, 3]
    total = [c + n for c, n in zip(cached, new)]
    k_cache, v_cache, table = make_pool(total, page, 2, 64, DTYPE)
    q = randn(sum(new), 4, 64, dtype=DTYPE)
    cq, ck = cu_seqlens(new), cu_seqlens(total)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(new), max(total), window_size=window,
                                 block_table=table, num_splits=2)
    want = ref.paged_varlen_attention_ref(q, k_cache, v_cache, cq, ck, table, window_size=window)[0]
    assert_close(out, want, DTYPE)

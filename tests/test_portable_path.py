"""On a Hopper GPU, contiguous K/V go through tensor-descriptor (TMA) loads. The portable pointer path
must stay correct there too: these cases run with TMA switched off (on the CPU they are the same
path the rest of the suite already covers, so they are skipped)."""

import pytest
import torch
from conftest import ON_GPU, assert_close, cu_seqlens, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from pagedflash import reference as ref
from pagedflash.ops import launch

pytestmark = pytest.mark.skipif(not ON_GPU, reason="only differs from the default path on a GPU")


@pytest.fixture(params=[True, False], ids=["tma", "pointers"])
def tma(request, monkeypatch):
    monkeypatch.setattr(launch, "TMA", request.param)
    return request.param


@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_dense(tma, d, causal):
    q = randn(2, 300, 8, d, dtype=torch.bfloat16)
    k, v = randn(2, 333, 2, d, dtype=torch.bfloat16), randn(2, 333, 2, d, dtype=torch.bfloat16)
    assert_close(flash_attn_func(q, k, v, causal=causal), ref.attention_ref(q, k, v, causal=causal)[0], torch.bfloat16)


def test_varlen(tma):
    lens = [1, 200, 0, 77, 513]
    q = randn(sum(lens), 4, 128, dtype=torch.float16)
    k, v = randn(sum(lens), 4, 128, dtype=torch.float16), randn(sum(lens), 4, 128, dtype=torch.float16)
    cu = cu_seqlens(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, window_size=(100, 0))
    want = ref.varlen_attention_ref(q, k, v, cu, cu, causal=True, window_size=(100, 0))[0]
    assert_close(out, want, torch.float16)


@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode(tma, num_splits):
    q = randn(3, 1, 32, 128, dtype=torch.bfloat16)
    k_cache, v_cache = randn(3, 999, 8, 128, dtype=torch.bfloat16), randn(3, 999, 8, 128, dtype=torch.bfloat16)
    lens = torch.tensor([999, 0, 517], dtype=torch.int32, device=q.device)
    k_cache[2, 517:] = float("nan")  # past the length: must never be read
    v_cache[2, 517:] = float("nan")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=num_splits)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, lens)[0], torch.bfloat16)

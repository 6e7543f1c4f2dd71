"""Property tests: random shapes, lengths, masks and page layouts, every kernel against the reference.

The hand-picked cases in the other files cover the edges we know; these draw the combinations we
did not think of (hypothesis shrinks a failure to a small reproducer)."""

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, cu_seqlens, make_pool, randn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from pagedflash import reference as ref

SETTINGS = settings(max_examples=60 if ON_GPU else 25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HEAD_DIMS = st.sampled_from([16, 24, 40, 64, 72, 96, 128] if ON_GPU else [16, 24, 40, 64])
DTYPE = st.sampled_from(DTYPES)


@st.composite
def masks(draw):
    causal = draw(st.booleans())
    left = draw(st.sampled_from([-1, 0, 1, 7, 33]))
    right = draw(st.sampled_from([-1, 0, 2, 9]))
    softcap = draw(st.sampled_from([0.0, 0.0, 4.0]))
    return dict(causal=causal, window_size=(left, right), softcap=softcap)


@SETTINGS
@given(b=st.integers(1, 3), sq=st.integers(1, 70), sk=st.integers(1, 70), hkv=st.integers(1, 3),
       group=st.sampled_from([1, 2, 3, 4]), d=HEAD_DIMS, dtype=DTYPE, opts=masks())
def test_dense_prefill(b, sq, sk, hkv, group, d, dtype, opts):
    q = randn(b, sq, hkv * group, d, dtype=dtype)
    k, v = randn(b, sk, hkv, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype)
    out, lse = flash_attn_func(q, k, v, return_lse=True, **opts)
    ref_out, ref_lse = ref.attention_ref(q, k, v, **opts)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


@SETTINGS
@given(data=st.data(), page=st.sampled_from([1, 3, 8, 16, 32]), group=st.sampled_from([1, 2, 4]),
       d=HEAD_DIMS, splits=st.sampled_from([0, 1, 2, 5]), dtype=DTYPE)
def test_paged_varlen_mixed_batches(data, page, group, d, splits, dtype):
    n = data.draw(st.integers(1, 5), label="sequences")
    new = data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n), label="new tokens")
    cached = data.draw(st.lists(st.integers(0, 60), min_size=n, max_size=n), label="cached tokens")
    total = [c + q for c, q in zip(cached, new)]
    hkv = 2
    k_cache, v_cache, table = make_pool(total, page, hkv, d, dtype, spare=2)
    q = randn(sum(new), hkv * group, d, dtype=dtype)
    cq, ck = cu_seqlens(new), cu_seqlens(total)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(new), max(total), causal=True,
                                 block_table=table, num_splits=splits)
    assert_close(out, ref.paged_varlen_attention_ref(q, k_cache, v_cache, cq, ck, table, causal=True)[0], dtype)


@SETTINGS
@given(b=st.integers(1, 4), s_max=st.integers(1, 150), sq=st.integers(1, 6), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 4, 5, 8]), d=HEAD_DIMS, splits=st.sampled_from([0, 1, 3, 17]),
       data=st.data(), dtype=DTYPE)
def test_decode_contiguous(b, s_max, sq, hkv, group, d, splits, data, dtype):
    lens = data.draw(st.lists(st.integers(0, s_max), min_size=b, max_size=b), label="cache_seqlens")
    q = randn(b, sq, hkv * group, d, dtype=dtype)
    k_cache, v_cache = randn(b, s_max, hkv, d, dtype=dtype), randn(b, s_max, hkv, d, dtype=dtype)
    for i, n in enumerate(lens):  # past the length: never read
        k_cache[i, n:] = float("nan")
        v_cache[i, n:] = float("nan")
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits,
                                       return_lse=True)
    ref_out, ref_lse = ref.kvcache_attention_ref(q, k_cache, v_cache, seqlens)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])

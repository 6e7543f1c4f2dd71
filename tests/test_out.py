"""``out=``: a preallocated output for flash_attn_func, flash_attn_varlen_func and
flash_attn_with_kvcache, as serving engines pass one.

The result is written into ``out`` and ``out`` itself is returned, bitwise equal to the allocating
call; strided and misaligned views are honoured without touching the memory around them; a bad
``out`` is refused by name before anything is written (caches included).
"""

import pytest
import torch
from helpers import DEVICE, cu_seqlens, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def _dense():
    torch.manual_seed(0)
    q, k, v = randn(2, 9, 4, 40), randn(2, 13, 2, 40), randn(2, 13, 2, 40)
    return lambda **kw: flash_attn_func(q, k, v, causal=True, return_lse=True, **kw), q


def _varlen():
    torch.manual_seed(0)
    lq, lk = [5, 1, 8], [9, 3, 8]
    q, k, v = randn(sum(lq), 4, 24), randn(sum(lk), 2, 24), randn(sum(lk), 2, 24)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    return lambda **kw: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True,
                                               **kw), q


def _paged():
    torch.manual_seed(0)
    lq, lk = [5, 1, 8], [17, 3, 8]
    k_cache, v_cache, table = make_pool(lk, 5, 2, 24, torch.float32)
    q = randn(sum(lq), 4, 24)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    return lambda **kw: flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lq), max(lk), causal=True,
                                               block_table=table, num_splits=2, return_lse=True, **kw), q


def _kvcache():
    """Appending new tokens: each call starts from the same cache contents."""
    torch.manual_seed(0)
    k_cache0, v_cache0 = randn(3, 16, 2, 40), randn(3, 16, 2, 40)
    q, k, v = randn(3, 2, 4, 40), randn(3, 2, 2, 40), randn(3, 2, 2, 40)
    lens = torch.tensor([14, 0, 7], dtype=torch.int32, device=DEVICE)

    def run(**kw):
        k_cache, v_cache = k_cache0.clone(), v_cache0.clone()
        return flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, num_splits=3,
                                       return_lse=True, **kw)

    return run, q


def _kvcache_paged():
    torch.manual_seed(0)
    lens = [11, 0, 4]
    k_cache, v_cache, table = make_pool([n + 1 for n in lens], 4, 1, 24, torch.float32)
    q = randn(3, 1, 5, 24)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return lambda **kw: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                                return_lse=True, **kw), q


CALLS = {"dense": _dense, "varlen": _varlen, "paged": _paged, "kvcache": _kvcache, "kvcache_paged": _kvcache_paged}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("name", list(CALLS))
def test_out_is_written_and_returned_bitwise_equal(name):
    run, q = CALLS[name]()
    want, want_lse = run()
    out = torch.empty_like(q)  # NaN-poisoned: every element must be written
    got, lse = run(out=out)
    assert got is out
    assert torch.equal(_bits(out), _bits(want)) and torch.equal(_bits(lse), _bits(want_lse))


@pytest.mark.parametrize("name", list(CALLS))
def test_strided_and_misaligned_out_views_are_honoured(name):
    """out as a head-slice of a wider NaN buffer, and as a view starting one element into its
    storage (not 16-byte aligned): the result lands in the view, the memory around it stays NaN."""
    run, q = CALLS[name]()
    want, _ = run()
    wide = torch.full((*q.shape[:-2], q.shape[-2] + 3, q.shape[-1]), float("nan"), device=DEVICE)
    got, _ = run(out=wide[..., 1:-2, :])
    assert got.data_ptr() == wide[..., 1:-2, :].data_ptr()
    assert torch.equal(_bits(wide[..., 1:-2, :]), _bits(want))
    assert wide[..., :1, :].isnan().all() and wide[..., -2:, :].isnan().all()
    flat = torch.full((q.numel() + 1,), float("nan"), device=DEVICE)
    shifted = flat[1:].view(q.shape)
    run(out=shifted)
    assert torch.equal(_bits(shifted), _bits(want)) and flat[0].isnan()


def _bad_outs(q):
    """(out, exception, message) that must be refused."""
    yield [1.0], TypeError, "out: expected a torch.Tensor or None, got list"
    yield torch.empty(*q.shape[:-1], q.shape[-1] + 1, device=DEVICE), ValueError, "out: expected shape"
    yield torch.empty(q.shape, dtype=torch.float16, device=DEVICE), TypeError, "out: expected dtype torch.float32"
    yield torch.empty(q.shape, device="meta"), ValueError, f"out: expected a tensor on {q.device}"
    transposed = torch.empty(*q.shape[:-2], q.shape[-1], q.shape[-2], device=DEVICE).transpose(-1, -2)
    yield transposed, ValueError, "out: the last dimension must be contiguous"
    yield torch.empty(q.shape[-1], device=DEVICE).expand(q.shape), ValueError, "out: expected every element"
    yield torch.zeros(q.shape, device=DEVICE, requires_grad=True), ValueError, "out: requires grad"
    yield q, ValueError, "out: shares memory with q"


@pytest.mark.parametrize("name", ["dense", "varlen", "kvcache"])
def test_bad_out_is_refused_by_name(name):
    run, q = CALLS[name]()
    for out, exc, message in _bad_outs(q):
        with pytest.raises(exc, match=message):
            run(out=out)


def test_out_sharing_memory_with_an_input_is_refused():
    torch.manual_seed(0)
    q = randn(2, 4, 4, 32)
    k_cache, v_cache = randn(2, 16, 2, 32), randn(2, 16, 2, 32)
    k, v = randn(2, 1, 2, 32), randn(2, 1, 2, 32)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    calls = {
        "k": lambda out: flash_attn_func(q, k_cache, v_cache, out=out),
        "k_cache": lambda out: flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, out=out),
    }
    in_k = k_cache.view(-1)[: q.numel()].view(q.shape)
    for name, call in calls.items():
        before = k_cache.clone(), v_cache.clone()
        with pytest.raises(ValueError, match=f"out: shares memory with {name}"):
            call(in_k)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "refused, yet the cache changed"
    in_v = v_cache.view(-1)[5: 5 + q.numel()].view(q.shape)
    with pytest.raises(ValueError, match="out: shares memory with v"):
        flash_attn_func(q, k_cache, v_cache, out=in_v)


@pytest.mark.parametrize("name", ["varlen", "paged"])
def test_varlen_out_must_match_packed_q(name):
    run, q = CALLS[name]()
    with pytest.raises(ValueError, match=r"out: expected shape \(14, 4, 24\) \(q.s\), got \(13, 4, 24\)"):
        run(out=torch.empty(q.shape[0] - 1, *q.shape[1:], device=DEVICE))

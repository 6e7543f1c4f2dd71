"""Bad input gets a clear error naming the argument, before any launch."""

import pytest
import torch
from helpers import DEVICE, randn

from pagedflash import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    merge_attn_states,
    write_kv_cache,
)


def qkv(b=1, s=8, hq=4, hkv=2, d=32, dtype=torch.float32):
    return randn(b, s, hq, d, dtype=dtype), randn(b, s, hkv, d, dtype=dtype), randn(b, s, hkv, d, dtype=dtype)


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda q, k, v: (q.half(), k, v), TypeError, "k: expected dtype torch.float16"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q: expected a 4-D tensor"),
        (lambda q, k, v: (q[..., :3, :], k, v), ValueError, "Hq must be a multiple of Hkv"),
        (lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8]), ValueError, r"head dim must be in \[16, 256\]"),
        (lambda q, k, v: (q, k, v[..., :16]), ValueError, "v: expected head dim 32"),
        (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), ValueError,
         "q: the last dimension must be contiguous"),
        (lambda q, k, v: (q.int(), k, v), TypeError, "q: expected dtype in"),
        (lambda q, k, v: (q, k[:, :4], v), ValueError, "v: expected shape"),
        (lambda q, k, v: (q, "k", v), TypeError, "k: expected a torch.Tensor, got str"),
    ],
)
def test_flash_attn_func_rejects(mutate, exc, match):
    with pytest.raises(exc, match=match):
        flash_attn_func(*mutate(*qkv()))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(window_size=(-2, 0)), ValueError, "window_size"),
        (dict(window_size=3), TypeError, "window_size"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    ],
)
def test_options_rejected(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        flash_attn_func(*qkv(), **kwargs)


def test_mixed_devices_rejected():
    if DEVICE.type == "cpu":
        pytest.skip("needs a second device")
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k: expected a tensor on"):
        flash_attn_func(q, k.cpu(), v)


def _varlen(**over):
    q, k, v = randn(10, 4, 32), randn(12, 2, 32), randn(12, 2, 32)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=i32([0, 4, 10]), cu_seqlens_k=i32([0, 5, 12]), max_seqlen_q=6,
                max_seqlen_k=7)
    args.update(over)
    return flash_attn_varlen_func(**args)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 4, 10], device=DEVICE)), TypeError, "cu_seqlens_q: expected dtype torch.int32"),
        (dict(cu_seqlens_q=i32([0, 6, 4])), ValueError, "cu_seqlens_q: expected non-decreasing"),
        (dict(cu_seqlens_q=i32([0, 4, 9])), ValueError, r"cu_seqlens_q: expected the last offset to equal q.shape\[0\]"),
        (dict(cu_seqlens_k=i32([0, 5, 11])), ValueError, r"cu_seqlens_k: expected the last offset to equal k.shape\[0\]"),
        (dict(cu_seqlens_k=i32([0, 5])), ValueError, r"cu_seqlens_k: expected shape \(3,\)"),
        (dict(cu_seqlens_q=i32([1, 4, 10])), ValueError, "cu_seqlens_q: expected to start at 0"),
        (dict(cu_seqlens_q=i32([0, 0, 4, 4, 10])[::2]), ValueError, "cu_seqlens_q: expected a contiguous"),
        (dict(max_seqlen_q=3), ValueError, "more than max_seqlen"),
        (dict(max_seqlen_k=-1), TypeError, "max_seqlen_k"),
        (dict(num_splits=-1), ValueError, "num_splits"),
    ],
)
def test_varlen_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        _varlen(**over)


def _paged(**over):
    k_cache, v_cache = randn(6, 4, 2, 32), randn(6, 4, 2, 32)
    args = dict(q=randn(2, 1, 4, 32), k_cache=k_cache, v_cache=v_cache, cache_seqlens=i32([5, 8]),
                block_table=i32([[0, 1], [2, 3]]))
    args.update(over)
    return flash_attn_with_kvcache(**args)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(block_table=torch.tensor([[0, 1], [2, 3]], device=DEVICE)), TypeError, "block_table: expected dtype torch.int32"),
        (dict(block_table=i32([0, 1])), ValueError, "block_table: expected a 2-D tensor"),
        (dict(block_table=i32([[0, 1]])), ValueError, "block_table: expected 2 rows"),
        (dict(cache_seqlens=i32([5, 9])), ValueError, "exceeds the cache capacity 8"),
        (dict(block_table=i32([[0, 1], [2, 6]])), ValueError, r"block_table: page ids must be in \[0, 6\)"),
        (dict(block_table=i32([[0, 1], [-1, 3]])), ValueError, "block_table: page ids"),
        (dict(v_cache=randn(6, 4, 2, 32)[:, :, :, :]), None, None),
        (dict(v_cache=randn(7, 4, 2, 32)), ValueError, "v_cache: expected shape"),
        (dict(cache_seqlens=None), ValueError, "cache_seqlens: required with block_table"),
        (dict(cache_seqlens=torch.tensor([5, 8], device=DEVICE)), TypeError, "cache_seqlens: expected dtype torch.int32"),
        (dict(cache_seqlens=i32([5, 8, 1])), ValueError, r"cache_seqlens: expected shape \(2,\)"),
        (dict(num_splits=-2), ValueError, "num_splits: expected an int >= 0"),
        (dict(k=randn(2, 1, 2, 32)), ValueError, "pass both new keys and new values"),
        (dict(k=randn(2, 1, 3, 32), v=randn(2, 1, 3, 32)), ValueError, r"k: expected shape \[B, S_new, Hkv, D\]"),
        (dict(cache_seqlens=i32([5, 8]), k=randn(2, 1, 2, 32), v=randn(2, 1, 2, 32)), ValueError,
         "exceeds the cache capacity"),
    ],
)
def test_kvcache_rejects(over, exc, match):
    if exc is None:
        _paged(**over)  # control: a valid variant passes
        return
    with pytest.raises(exc, match=match):
        _paged(**over)


def test_contiguous_cache_rejects_too_long():
    q, k_cache, v_cache = randn(2, 1, 4, 32), randn(2, 10, 2, 32), randn(2, 10, 2, 32)
    with pytest.raises(ValueError, match="cache_seqlens: cache_seqlens \\+ S_new = 11 exceeds"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32([3, 11]))
    with pytest.raises(ValueError, match="k_cache: expected batch 2"):
        flash_attn_with_kvcache(q, k_cache[:1], v_cache[:1], cache_seqlens=i32([3, 1]))


def test_paged_varlen_table_too_short():
    k_cache, v_cache = randn(6, 4, 2, 32), randn(6, 4, 2, 32)
    with pytest.raises(ValueError, match="block_table: sequence 1 has 9 tokens but the table holds 2 pages"):
        flash_attn_varlen_func(randn(3, 4, 32), k_cache, v_cache, i32([0, 1, 3]), i32([0, 5, 14]), 2, 9,
                               causal=True, block_table=i32([[0, 1], [2, 3]]))


def test_write_kv_cache_rejects():
    k_cache, v_cache = randn(4, 4, 2, 32), randn(4, 4, 2, 32)
    k, v = randn(3, 2, 32), randn(3, 2, 32)
    slots = torch.tensor([0, 5, -1], device=DEVICE)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    with pytest.raises(TypeError, match="slot_mapping: expected dtype torch.int64"):
        write_kv_cache(k, v, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match="slot_mapping: slots must be < num_blocks \\* page_size = 16"):
        write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 16, 1], device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping: expected shape \\(3,\\)"):
        write_kv_cache(k, v, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="k: expected shape \\[T, 2, 32\\]"):
        write_kv_cache(randn(3, 3, 32), randn(3, 3, 32), k_cache, v_cache, slots)
    with pytest.raises(TypeError, match="k: expected dtype"):
        write_kv_cache(k.half(), v.half(), k_cache, v_cache, slots)


def test_merge_rejects():
    o, lse = randn(2, 4, 32), randn(2, 4)
    with pytest.raises(ValueError, match="lse_b: expected shape"):
        merge_attn_states(o, lse, o, lse[:, :2])
    with pytest.raises(TypeError, match="lse_a: expected dtype"):
        merge_attn_states(o, lse.half(), o, lse)


def test_inputs_that_require_grad_are_refused_unless_autograd_is_off():
    """Forward-only kernels: with autograd on, an input that requires grad would get no gradient
    through attention without anyone noticing, so it is refused; under no_grad / inference_mode it runs."""
    q, k, v = qkv()
    cache, cu = randn(1, 16, 2, 32), i32([0, 8])

    def needs(t):
        return t.detach().requires_grad_(True)

    calls = [
        ("q", lambda: flash_attn_func(needs(q), k, v)),
        ("v", lambda: flash_attn_varlen_func(q[0], k[0], needs(v[0]), cu, cu, 8, 8)),
        ("k", lambda: flash_attn_with_kvcache(q, cache, cache.clone(), k=needs(k), v=v, cache_seqlens=1)),
        ("v_cache", lambda: flash_attn_with_kvcache(q, cache, needs(cache), cache_seqlens=8)),
        ("out_b", lambda: merge_attn_states(q[0], randn(8, 4), needs(q[0]), randn(8, 4))),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=f"{name}: requires grad, but pagedflash has no backward pass"):
            call()
        with torch.no_grad():
            call()
        with torch.inference_mode():
            call()

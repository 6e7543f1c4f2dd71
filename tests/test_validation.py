"""Bad input gets a clear error naming the argument, before any launch. Metadata values (cu_seqlens,
cache_seqlens, page ids) are checked on the host only in the debug mode (``validate.value_checks(True)``),
which the tests of those checks turn on; test_metadata_faults.py covers the default, where the kernels
check them."""

import numpy as np
import pytest
import torch
from helpers import DEVICE, randn

from pagedflash import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    merge_attn_states,
    reference,
    validate,
    write_kv_cache,
)
from pagedflash import flash_attn_interface as fa


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
    with validate.value_checks(True), pytest.raises(exc, match=match):
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
    with validate.value_checks(True), pytest.raises(exc, match=match):
        _paged(**over)


def test_contiguous_cache_rejects_too_long():
    q, k_cache, v_cache = randn(2, 1, 4, 32), randn(2, 10, 2, 32), randn(2, 10, 2, 32)
    with validate.value_checks(True):
        with pytest.raises(ValueError, match="cache_seqlens: cache_seqlens \\+ S_new = 11 exceeds"):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=i32([3, 11]))
    with pytest.raises(ValueError, match="k_cache: expected batch 2"):
        flash_attn_with_kvcache(q, k_cache[:1], v_cache[:1], cache_seqlens=i32([3, 1]))


def test_paged_varlen_table_too_short():
    k_cache, v_cache = randn(6, 4, 2, 32), randn(6, 4, 2, 32)
    match = "block_table: sequence 1 has 9 tokens but the table holds 2 pages"
    with validate.value_checks(True), pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(randn(3, 4, 32), k_cache, v_cache, i32([0, 1, 3]), i32([0, 5, 14]), 2, 9,
                               causal=True, block_table=i32([[0, 1], [2, 3]]))


def test_write_kv_cache_rejects():
    k_cache, v_cache = randn(4, 4, 2, 32), randn(4, 4, 2, 32)
    k, v = randn(3, 2, 32), randn(3, 2, 32)
    slots = torch.tensor([0, 5, -1], device=DEVICE)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    with pytest.raises(TypeError, match="slot_mapping: expected dtype torch.int64"):
        write_kv_cache(k, v, k_cache, v_cache, slots.int())
    with validate.value_checks(True), pytest.raises(ValueError, match="slot_mapping: slots must be < num_blocks \\* page_size = 16"):
        write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 16, 1], device=DEVICE))  # the debug mode's host check
    with pytest.raises(ValueError, match="slot_mapping: expected shape \\(3,\\)"):
        write_kv_cache(k, v, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="k: expected shape \\[T, 2, 32\\]"):
        write_kv_cache(randn(3, 3, 32), randn(3, 3, 32), k_cache, v_cache, slots)
    with pytest.raises(TypeError, match="k: expected dtype"):
        write_kv_cache(k.half(), v.half(), k_cache, v_cache, slots)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter, on the unchecked NaN sink
def test_scale_and_sink_values_are_checked_only_with_value_checks_on():
    """The checks that read device values (a descale finite and > 0, no NaN or +inf sink) are gated
    as the metadata checks are (off with set_value_checks(False), under CUDA-graph capture and while
    compiling); the structural ones (dtype, shape, device) always run; flash_attn_interface raises
    them as RuntimeErrors too."""
    q, cache = randn(1, 1, 4, 32), randn(1, 8, 2, 32).to(torch.float8_e4m3fn)
    zero, nan = torch.zeros(2, device=DEVICE), torch.full((4,), float("nan"), device=DEVICE)
    call = lambda **kw: flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=8, **kw)  # noqa: E731
    with validate.value_checks(True):
        with pytest.raises(ValueError, match=r"k_descale: expected finite values > 0, got \[0.0, 0.0\]"):
            call(k_descale=zero)
        with pytest.raises(ValueError, match="sinks: expected finite logits"):
            call(sinks=nan)
        with pytest.raises(RuntimeError, match="v_descale: expected finite values > 0"):
            fa.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=8, v_descale=zero)
    with validate.value_checks(False):
        call(k_descale=zero, sinks=nan)  # no value read: the kernel runs on what it is given
        with pytest.raises(ValueError, match=r"k_descale: expected shape \[\] or \[1\] \(per tensor\) or \[2\]"):
            call(k_descale=torch.ones(3, device=DEVICE))
        with pytest.raises(TypeError, match="sinks: expected dtype"):
            call(sinks=nan.half())


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


# --- hostile options: softcap, window_size, zero heads, an empty rotary batch --------------------


@pytest.mark.parametrize("off", [None, float("inf"), 1e300], ids=["None", "inf", "past-fp32"])
def test_softcap_that_caps_nothing_is_no_cap(off):
    """None (transformers' "no cap"), inf and caps past fp32's range are the identity: exactly no cap."""
    q, k, v = qkv(s=19)
    assert torch.equal(flash_attn_func(q, k, v, softcap=off, causal=True), flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize(
    "softcap,exc,match",
    [
        ("2", TypeError, "softcap: expected a float .*got str"),
        (True, TypeError, "softcap: expected a float .*got bool"),
        (torch.tensor(2.0), TypeError, "softcap: expected a float .*got Tensor"),
        (float("nan"), ValueError, "softcap: expected 0, None or inf .*got nan"),
        (-1.0, ValueError, "softcap: expected 0, None or inf .*got -1.0"),
        (float("-inf"), ValueError, "softcap: expected 0, None or inf"),
        (1e-39, ValueError, "softcap: .* a value >= 1.18e-38, got 1e-39"),
    ],
)
def test_softcap_rejects(softcap, exc, match):
    with pytest.raises(exc, match=match):
        flash_attn_func(*qkv(), softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("softcap", [1e6, 50.0, 1.0, 0.01])
def test_softcap_accurate_for_any_cap(softcap, dtype):
    """Scores up to about 30 under caps from 0.01 to 1e6: both sides of soft_cap's series/exp2 switch
    (|s / cap| = 1/4). The former ``cap - 2 cap / (exp(2 s / cap) + 1)`` lost 0.12 at cap 1e6."""
    torch.manual_seed(0)
    q, k, v = (t * 3 if i < 2 else t for i, t in enumerate(qkv(b=2, s=40, dtype=dtype)))
    out, lse = flash_attn_func(q, k, v, softcap=softcap, causal=True, return_lse=True)
    want, want_lse = reference.attention_ref(q, k, v, softcap=softcap, causal=True)
    torch.testing.assert_close(lse, want_lse, atol=5e-5, rtol=2e-6)
    torch.testing.assert_close(out.float(), want, **({"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32
                                                      else {"atol": 2e-3, "rtol": 2e-3}))


def test_window_sides_past_any_sequence_are_unbounded():
    """A side of 2**30 or more covers every key (and used to overflow the kernels' int32 positions:
    2**31 - 2 on the right gave wrong output, 10**30 an OverflowError inside Triton)."""
    q, k, v = qkv(s=13)
    q = q[:, :9]
    unbounded = flash_attn_func(q, k, v)
    for window in [(-1, 2**31 - 2), (2**31 - 2, -1), (2**30, 2**30), (2**63, 2**63 - 1), (10**30, 10**40)]:
        assert torch.equal(flash_attn_func(q, k, v, window_size=window), unbounded), window
    causal = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(2**40, 7), causal=True), causal)
    numpy_ints = flash_attn_func(q, k, v, window_size=tuple(np.int64(w) for w in (3, 2)))
    assert torch.equal(numpy_ints, flash_attn_func(q, k, v, window_size=(3, 2)))


@pytest.mark.parametrize("window", [(3.0, -1), (-1, 2.5), (True, -1), (-1, False), (1, 2, 3), (4,), None, "ab"],
                         ids=str)
def test_window_rejects_non_ints(window):
    with pytest.raises(TypeError, match=r"window_size: expected a pair of ints \(left, right\)"):
        flash_attn_func(*qkv(), window_size=window)


def test_zero_query_heads_rejected():
    q, k, v = qkv()
    cu = i32([0, 8])
    calls = [
        lambda: flash_attn_func(q[:, :, :0], k, v),
        lambda: flash_attn_varlen_func(q[0, :, :0], k[0], v[0], cu, cu, 8, 8),
        lambda: flash_attn_with_kvcache(q[:, :1, :0], k, v, cache_seqlens=3),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="heads: Hq must be a multiple of Hkv, both at least 1, got Hq=0, Hkv=2"):
            call()


def test_rotary_kvcache_with_a_batch_of_zero():
    """flash_attn_interface's rotary path over an empty batch: the same empty output as without rotary."""
    q, k_cache = randn(0, 3, 4, 32), randn(0, 16, 2, 32)
    k_new, v_new = randn(0, 2, 2, 32), randn(0, 2, 2, 32)
    cos, sin = randn(16, 8), randn(16, 8)
    lens = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k_new, v_new, cos, sin, lens, causal=True,
                                          return_softmax_lse=True)
    assert out.shape == (0, 3, 4, 32) and lse.shape == (0, 4, 3)

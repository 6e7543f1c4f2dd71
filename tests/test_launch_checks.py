"""Input checks kept per call signature (:func:`pagedflash.ops.utils.checked_signature`): the key
holds every property the checks read, so a signature seen before never lets a bad call through.
The kernels are replaced by a no-op (host logic only)."""

import pytest
import torch
from helpers import DEVICE, randn

from pagedflash import flash_attn_func, flash_attn_with_kvcache, validate
from pagedflash.ops import attention, combine, decode, prefill
from pagedflash.ops.utils import checked_signature, new_output


class _NoKernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(attention, "_attention_kernel", _NoKernel())
    monkeypatch.setattr(combine, "_combine_kernel", _NoKernel())
    attention.clear_plans()
    yield
    attention.clear_plans()


# ---------------------------------------------------------------- the key


def test_signature_separates_every_property_the_checks_read():
    q = randn(2, 1, 4, 32)
    base = checked_signature((q, None), (None, True, (-1, -1), 0.0))
    assert base is not None and base == checked_signature((randn(2, 1, 4, 32), None), (None, True, (-1, -1), 0.0))
    variants = [
        ((randn(2, 2, 4, 32), None), (None, True, (-1, -1), 0.0)),  # shape
        ((randn(2, 4, 1, 32).transpose(1, 2), None), (None, True, (-1, -1), 0.0)),  # strides
        ((q.half(), None), (None, True, (-1, -1), 0.0)),  # dtype
        ((q, q), (None, True, (-1, -1), 0.0)),  # an optional tensor given
        ((q, None), (None, 1, (-1, -1), 0.0)),  # True and 1
        ((q, None), (None, True, (True, -1), 0.0)),  # inside a tuple too
        ((q, None), (None, True, (-1, -1), 0)),  # 0.0 and 0
        ((q, None), (1.0, True, (-1, -1), 0.0)),
    ]
    keys = [checked_signature(*v) for v in variants]
    assert None not in keys and len({base, *keys}) == len(keys) + 1


def test_signature_tracks_requires_grad_only_where_autograd_is_on():
    q, leaf = randn(1, 1, 2, 16), randn(1, 1, 2, 16).requires_grad_()
    assert checked_signature((q,), ()) != checked_signature((leaf,), ())
    with torch.no_grad():
        assert checked_signature((q,), ()) == checked_signature((leaf,), ())


@pytest.mark.parametrize("scalars", [(torch.tensor(1.0),), ([1, 2],), ((1, [2]),), ("a",), ((1, 2.0, torch.ones(1)),)])
def test_signature_is_none_for_values_that_are_not_plain_scalars(scalars):
    assert checked_signature((randn(1, 1, 2, 16),), scalars) is None


def test_signature_is_none_for_a_non_tensor_or_with_value_checks_on():
    assert checked_signature(([1, 2],), ()) is None
    with validate.value_checks(True):
        assert checked_signature((randn(1, 1, 2, 16),), ()) is None


def test_new_output_is_a_contiguous_tensor_like_q():
    q = randn(2, 4, 3, 16).transpose(1, 2)  # dense but not contiguous: empty_like alone would keep its strides
    out = new_output(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.is_contiguous()
    assert not out.requires_grad and new_output(randn(2, 3).requires_grad_()).requires_grad is False


# ---------------------------------------------------------------- public calls after a good call


def _decode(**over):
    args = dict(q=randn(2, 1, 4, 32), k_cache=randn(2, 24, 2, 32), v_cache=randn(2, 24, 2, 32),
                cache_seqlens=torch.tensor([20, 9], dtype=torch.int32, device=DEVICE))
    args.update(over)
    return flash_attn_with_kvcache(**args)


def _prefill(**over):
    args = dict(q=randn(1, 8, 4, 32), k=randn(1, 8, 2, 32), v=randn(1, 8, 2, 32), causal=True)
    args.update(over)
    return flash_attn_func(**args)


_DECODE_BAD = [
    (dict(window_size=(True, -1)), TypeError, "window_size"),
    (dict(window_size=[-1, -1.5]), TypeError, "window_size"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(cache_seqlens=torch.tensor([20, 9], device=DEVICE)), TypeError, "cache_seqlens"),
    (dict(cache_seqlens=torch.tensor([20, 0, 9, 0], dtype=torch.int32, device=DEVICE)[::2]), ValueError,
     "cache_seqlens"),
    (dict(cache_seqlens=True), TypeError, "cache_seqlens"),
    (dict(q=randn(2, 1, 4, 32).requires_grad_()), ValueError, "requires grad"),
    (dict(v_cache=randn(2, 24, 2, 32).half()), TypeError, "v_cache"),
]


@pytest.mark.parametrize("over,exc,match", _DECODE_BAD, ids=[str(i) for i in range(len(_DECODE_BAD))])
def test_decode_checks_after_a_good_call(no_kernels, over, exc, match):
    for _ in range(2):
        _decode()  # the good signature is seen (and kept, where the checks are kept)
    with pytest.raises(exc, match=match):
        _decode(**over)


def test_decode_value_checks_run_on_a_kept_signature(no_kernels):
    for _ in range(2):
        _decode()
    with validate.value_checks(True), pytest.raises(ValueError, match="cache_seqlens"):
        _decode(cache_seqlens=torch.tensor([20, 25], dtype=torch.int32, device=DEVICE))


_PREFILL_BAD = [
    (dict(window_size=(True, -1)), TypeError, "window_size"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(q=randn(1, 8, 4, 32).requires_grad_()), ValueError, "requires grad"),
    (dict(v=randn(1, 8, 2, 32).half()), TypeError, "v"),
    (dict(sinks=randn(4).double()), TypeError, "sinks"),
    (dict(out=randn(1, 8, 4, 32).half()), TypeError, "out"),
]


@pytest.mark.parametrize("over,exc,match", _PREFILL_BAD, ids=[str(i) for i in range(len(_PREFILL_BAD))])
def test_prefill_checks_after_a_good_call(no_kernels, over, exc, match):
    for _ in range(2):
        _prefill()
    with pytest.raises(exc, match=match):
        _prefill(**over)


def test_results_of_kept_checks_are_the_fresh_ones(no_kernels, monkeypatch):
    """A kept signature launches with the arguments its checks normalized (scale, window, softcap)."""
    seen = []
    real = attention.attention_forward

    real_kept = attention.kept_forward

    def spy(*args, **kwargs):
        seen.append((kwargs["sm_scale"], kwargs["window"], kwargs["softcap"]))
        return real(*args, **kwargs)

    def spy_kept(signature, q, k, v, out, return_lse, seqused_k, block_table, sm_scale, softcap, left, right, *rest):
        done = real_kept(signature, q, k, v, out, return_lse, seqused_k, block_table, sm_scale, softcap, left, right,
                         *rest)
        if done is not None:  # None: no plan kept, attention_forward follows
            seen.append((sm_scale, (left, right), softcap))
        return done

    monkeypatch.setattr(decode, "attention_forward", spy)
    monkeypatch.setattr(decode, "kept_forward", spy_kept)
    monkeypatch.setattr(prefill, "attention_forward", spy)
    monkeypatch.setattr(prefill, "kept_forward", spy_kept)
    for _ in range(3):
        _decode(softmax_scale=2, window_size=(3, 2**31), softcap=float("inf"))
        _prefill(window_size=(4, 9), softcap=5)
    assert seen[0::2] == [(2.0, (3, 0), 0.0)] * 3
    assert seen[1::2] == [(32 ** -0.5, (4, 0), 5.0)] * 3
    assert isinstance(seen[1][2], float)

"""Input checks kept per call signature (:func:`pagedflash.ops.utils.checked_signature`): the key
holds every property the checks read, so a signature seen before never lets a bad call through.
The kernels are replaced by a no-op (host logic only)."""

import pytest
import torch
from helpers import DEVICE, cu_seqlens, fp8_pool, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, validate
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
        flash_attn_varlen_func(**dict(_varlen_case("paged"), softmax_scale=1, window_size=(2, -1), softcap=7))
    assert seen[0::3] == [(2.0, (3, 0), 0.0)] * 3
    assert seen[1::3] == [(32 ** -0.5, (4, 0), 5.0)] * 3
    assert seen[2::3] == [(1.0, (2, 0), 7.0)] * 3
    assert isinstance(seen[1][2], float) and isinstance(seen[2][0], float)


# ---------------------------------------------------------------- varlen

_LENS_Q, _LENS_K = [5, 3], [9, 7]
_LAYOUTS = ("packed", "paged", "fp8")


def _varlen_case(layout: str) -> dict:
    """A good flash_attn_varlen_func call over packed K/V, a paged cache, or an fp8 paged cache with
    per-KV-head descales."""
    args = dict(q=randn(sum(_LENS_Q), 4, 32), cu_seqlens_q=cu_seqlens(_LENS_Q), cu_seqlens_k=cu_seqlens(_LENS_K),
                max_seqlen_q=max(_LENS_Q), max_seqlen_k=max(_LENS_K), causal=True)
    if layout == "packed":
        return dict(args, k=randn(sum(_LENS_K), 2, 32), v=randn(sum(_LENS_K), 2, 32))
    if layout == "paged":
        k, v, table = make_pool(_LENS_K, 4, 2, 32, torch.float32)
        return dict(args, k=k, v=v, block_table=table)
    k, v, table = fp8_pool(_LENS_K, 4, 2, 32)
    descale = torch.tensor([0.5, 2.0], device=DEVICE)
    return dict(args, k=k, v=v, block_table=table, k_descale=descale, v_descale=descale.clone())


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor of the same shape and dtype with another stride."""
    return torch.stack([t, t], dim=-1)[..., 0]


# (layouts, overrides from the good case, exception, message): each changes one thing of a kept signature
_VARLEN_BAD = [
    (_LAYOUTS, lambda c: dict(window_size=(True, -1)), TypeError, "window_size"),
    (_LAYOUTS, lambda c: dict(window_size=(-2, 0)), ValueError, "window_size"),
    (_LAYOUTS, lambda c: dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (_LAYOUTS, lambda c: dict(softcap=True), TypeError, "softcap"),
    (_LAYOUTS, lambda c: dict(num_splits=-1), ValueError, "num_splits"),
    (_LAYOUTS, lambda c: dict(num_splits=1.0), ValueError, "num_splits"),
    (_LAYOUTS, lambda c: dict(max_seqlen_q=5.0), TypeError, "max_seqlen_q"),
    (_LAYOUTS, lambda c: dict(max_seqlen_k=-1), TypeError, "max_seqlen_k"),
    (_LAYOUTS, lambda c: dict(max_seqlen_q=torch.tensor(5)), TypeError, "max_seqlen_q"),
    (_LAYOUTS, lambda c: dict(cu_seqlens_q=c["cu_seqlens_q"].long()), TypeError, "cu_seqlens_q"),
    (_LAYOUTS, lambda c: dict(cu_seqlens_q=c["cu_seqlens_q"][:1]), ValueError, "cu_seqlens_q"),
    (_LAYOUTS, lambda c: dict(cu_seqlens_k=_noncontiguous(c["cu_seqlens_k"])), ValueError, "cu_seqlens_k"),
    (_LAYOUTS, lambda c: dict(cu_seqlens_k=c["cu_seqlens_k"][:2]), ValueError, "cu_seqlens_k"),
    (_LAYOUTS, lambda c: dict(q=c["q"].clone().requires_grad_()), ValueError, "requires grad"),
    (_LAYOUTS, lambda c: dict(q=c["q"][:, :, :16]), ValueError, "head dim"),
    (_LAYOUTS, lambda c: dict(v=c["v"].double()), TypeError, "v"),
    (_LAYOUTS, lambda c: dict(sinks=randn(4).double()), TypeError, "sinks"),
    (_LAYOUTS, lambda c: dict(sinks=randn(3)), ValueError, "sinks"),
    (_LAYOUTS, lambda c: dict(out=randn(*c["q"].shape).half()), TypeError, "out"),
    (_LAYOUTS, lambda c: dict(out=c["q"]), ValueError, "out: shares memory with q"),
    (_LAYOUTS, lambda c: dict(out=c["q"], batch_invariant=1), ValueError, "out: shares memory with q"),
    (_LAYOUTS, lambda c: dict(batch_invariant=1), TypeError, "batch_invariant"),
    (("packed",), lambda c: dict(v=c["v"][:-1]), ValueError, "v: expected shape"),
    (("packed", "paged"), lambda c: dict(k_descale=torch.ones(1, device=DEVICE)), ValueError, "k_descale"),
    (("paged", "fp8"), lambda c: dict(block_table=c["block_table"].long()), TypeError, "block_table"),
    (("paged", "fp8"), lambda c: dict(block_table=c["block_table"][:1]), ValueError, "block_table"),
    (("paged", "fp8"), lambda c: dict(block_table=None), ValueError, "k: expected a 3-D tensor"),
    (("paged", "fp8"), lambda c: dict(v=_noncontiguous(c["v"])), ValueError, "v"),
    (("fp8",), lambda c: dict(k_descale=c["k_descale"].double()), TypeError, "k_descale"),
    (("fp8",), lambda c: dict(v_descale=randn(3)), ValueError, "v_descale"),
    (("fp8",), lambda c: dict(v=c["v"].to(torch.float8_e5m2)), TypeError, "v"),
]
_VARLEN_CASES = [(layout, *bad) for i, bad in enumerate(_VARLEN_BAD) for layout in bad[0]]


@pytest.mark.parametrize("layout,layouts,over,exc,match", _VARLEN_CASES,
                         ids=[f"{c[0]}-{_VARLEN_BAD.index(c[1:])}" for c in _VARLEN_CASES])
def test_varlen_checks_after_a_good_call(no_kernels, layout, layouts, over, exc, match):
    """A bad call raises the same error, message included, as the first call of its signature and
    after the good signature it differs from in one thing is kept."""
    case = _varlen_case(layout)
    bad = dict(case, **over(case))
    prefill._CHECKED_VARLEN.clear()
    with pytest.raises(exc, match=match) as first:
        flash_attn_varlen_func(**bad)
    for _ in range(2):
        flash_attn_varlen_func(**case)
    with pytest.raises(exc, match=match) as again:
        flash_attn_varlen_func(**bad)
    assert str(again.value) == str(first.value)


@pytest.fixture
def check_calls(monkeypatch):
    """The calls of prefill._check_varlen (the varlen checks but out's) and of validate.check_out."""
    calls = {"varlen": 0, "out": 0}
    real_varlen, real_out = prefill._check_varlen, validate.check_out

    def varlen(*args):
        calls["varlen"] += 1
        return real_varlen(*args)

    def out(*args, **kwargs):
        calls["out"] += 1
        return real_out(*args, **kwargs)

    monkeypatch.setattr(prefill, "_check_varlen", varlen)
    monkeypatch.setattr(validate, "check_out", out)
    prefill._CHECKED_VARLEN.clear()
    return calls


@pytest.mark.parametrize("layout", _LAYOUTS)
def test_varlen_checks_run_once_per_signature(no_kernels, check_calls, layout):
    case = _varlen_case(layout)
    for _ in range(3):
        flash_attn_varlen_func(**case)
    flash_attn_varlen_func(**_varlen_case(layout))  # new tensors of the same properties: the same signature
    flash_attn_varlen_func(**case, return_lse=True, batch_invariant=True)  # not read by the checks
    assert check_calls["varlen"] == 1
    for _ in range(2):
        flash_attn_varlen_func(**case, out=torch.empty_like(case["q"]))  # out's checks: on every call
    assert check_calls == {"varlen": 1, "out": 2}
    wide = randn(case["q"].shape[0], 4, 64)[..., :32].copy_(case["q"])  # q's values, another stride
    changed = [dict(q=wide), dict(max_seqlen_k=max(_LENS_K) + 1), dict(max_seqlen_q=max(_LENS_Q), num_splits=2),
               dict(softmax_scale=0.5), dict(softmax_scale=1), dict(softmax_scale=1.0), dict(softcap=2),
               dict(softcap=2.0), dict(window_size=(3, -1)), dict(causal=False), dict(sinks=randn(4)),
               dict(cu_seqlens_k=torch.zeros(len(_LENS_K) + 2, dtype=torch.int32, device=DEVICE)[1:].copy_(
                   case["cu_seqlens_k"]))]  # another pointer alignment
    for n, over in enumerate(changed, start=2):  # each a signature of its own: checked on its first call only
        for _ in range(2):
            flash_attn_varlen_func(**dict(case, **over))
        assert check_calls["varlen"] == n, over
    with validate.value_checks(True):  # they read values: checked on every call
        for _ in range(2):
            flash_attn_varlen_func(**case)
    assert check_calls["varlen"] == len(changed) + 3


@pytest.mark.parametrize("layout", _LAYOUTS)
def test_varlen_value_checks_run_on_a_kept_signature(no_kernels, layout):
    case = _varlen_case(layout)
    for _ in range(2):
        flash_attn_varlen_func(**case)
    bad = [(dict(cu_seqlens_q=cu_seqlens([6, 2])), "cu_seqlens_q"),  # a sequence past max_seqlen_q
           (dict(cu_seqlens_k=cu_seqlens([9, 13])), "cu_seqlens_k")]  # packed: past k; paged: past max_seqlen_k
    if layout != "packed":
        table = case["block_table"].clone()
        table[1, 0] = case["k"].shape[0]  # a page id outside the pool
        bad.append((dict(block_table=table), "block_table"))
    if layout == "fp8":
        bad.append((dict(k_descale=torch.tensor([0.5, 0.0], device=DEVICE)), "k_descale"))
    with validate.value_checks(True):
        flash_attn_varlen_func(**case)
        for over, match in bad:
            with pytest.raises(ValueError, match=match):
                flash_attn_varlen_func(**dict(case, **over))
    for over, _ in bad:  # value checks off: the kept signature, its values unread (the kernel checks them)
        flash_attn_varlen_func(**dict(case, **over))

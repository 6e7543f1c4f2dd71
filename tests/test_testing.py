"""pagedflash.testing (the tolerance rule and the random page pools that tests, benchmarks and the
demo share) and the benchmarks' timing function, on the CPU."""

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, ON_GPU

from pagedflash.bench.common import time_ms
from pagedflash.cache import PAD_BLOCK_ID
from pagedflash.testing import (
    TOLERANCES,
    assert_close,
    check_close,
    compare,
    random_block_table,
    random_paged_kv,
    skip_interpreter_overflow_checks,
    skip_repeated_interpreter_patching,
    to_paged,
)


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helper_loop_kernel(X, Out, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    for _ in range(5):
        x = _twice(x)
    tl.store(Out + offs, x)


@triton.jit
def _add_one_kernel(X, Out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Out + offs, tl.load(X + offs) + 1)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_rule_scales_atol_with_the_reference(dtype):
    """A long-context decode output is of order 1e-3: zeros must fail, a rounding of the dtype pass."""
    ref = torch.randn(4, 8, 64) * 1e-3
    assert not compare(torch.zeros_like(ref), ref, dtype).ok
    err, ok = check_close(ref.to(dtype), ref, dtype)
    assert ok and err == pytest.approx((ref.to(dtype).float() - ref).abs().max().item() / ref.abs().max().item())


def test_rule_elementwise_allowance():
    atol, rtol = TOLERANCES[torch.float16]
    ref = torch.tensor([4.0, -2.0, 0.0, 1.0])
    inside = ref + torch.tensor([0.0, 0.0, atol * 4 * 0.99, rtol * 1.0 * 0.99 + atol * 4])
    assert compare(inside, ref, torch.float16).ok
    outside = ref.clone()
    outside[2] = atol * 4 * 1.01
    m = compare(outside, ref, torch.float16)
    assert m.bad.tolist() == [False, False, True, False] and m.err == pytest.approx(atol * 1.01)


def test_rule_infinities_nan_and_shapes():
    ref = torch.tensor([float("-inf"), 0.5, float("inf")])
    assert compare(ref.clone(), ref, torch.float32).ok  # equal infinities match (empty rows' LSE)
    assert not compare(torch.tensor([0.0, 0.5, float("inf")]), ref, torch.float32).ok
    nan = torch.tensor([float("-inf"), float("nan"), float("inf")])
    m = compare(nan, ref, torch.float32)
    assert not m.ok and math.isinf(m.err)
    assert compare(torch.zeros(0, 3), torch.zeros(0, 3), torch.float16).ok
    with pytest.raises(ValueError, match=r"output shape \(3,\) != reference shape \(2,\)"):
        compare(ref, ref[:2], torch.float32)


def test_assert_close_names_the_elements():
    ref = torch.ones(3, 4)
    got = ref.clone()
    got[1, 2] = 1.5
    assert_close(ref.clone(), ref, torch.float32)
    with pytest.raises(AssertionError, match=r"lse: 1/12 elements off .* \(1, 2\): got 1\.5, want 1"):
        assert_close(got, ref, torch.float32, name="lse")
    with pytest.raises(AssertionError, match=r"out: shape \(3, 4\) != reference \(4, 3\)"):
        assert_close(got, ref.T, torch.float32)


def test_random_block_table_rows_are_disjoint_pages_of_the_pool():
    table = random_block_table([3, 0, 5, 1], 20, device=DEVICE)
    assert table.dtype == torch.int32 and table.shape == (4, 5)
    rows = [table[b, :p].tolist() for b, p in enumerate([3, 0, 5, 1])]
    used = [x for r in rows for x in r]
    assert len(set(used)) == 9 and all(0 <= x < 20 for x in used)
    assert table[1].tolist() == [PAD_BLOCK_ID] * 5 and table[0, 3:].tolist() == [PAD_BLOCK_ID] * 2
    shared = random_block_table([3, 3, 2], 8, device=DEVICE, share_first=2)
    assert shared[1, :2].tolist() == shared[0, :2].tolist() == shared[2, :2].tolist()
    assert random_block_table([], 4, device=DEVICE).shape == (0, 1)
    with pytest.raises(ValueError, match="num_blocks must hold the 6 pages the rows need, got 5"):
        random_block_table([3, 3], 5, device=DEVICE)


def test_to_paged_keeps_every_key_in_its_page():
    b, n, page = 3, 12, 4
    cache = torch.arange(b * n * 2 * 5, dtype=torch.float32, device=DEVICE).view(b, n, 2, 5)
    table = random_block_table([n // page] * b, b * n // page, device=DEVICE)
    pool = to_paged(cache, page, table)
    assert pool.shape == (b * n // page, page, 2, 5)
    for s in range(b):
        for j in range(n // page):
            assert torch.equal(pool[table[s, j]], cache[s, j * page:(j + 1) * page])
    with pytest.raises(ValueError, match=r"block_table must cover the 3 x 12 keys in pages of 5"):
        to_paged(cache, 5, table)


@pytest.mark.parametrize("page", [1, 5, 16])
def test_random_paged_kv_is_nan_outside_the_slots_in_use(page):
    seqlens = [7, 0, 16, 33]
    k, v, table = random_paged_kv(seqlens, page, 2, 8, torch.float16, device=DEVICE)
    pages = [-(-n // page) for n in seqlens]
    assert k.shape == v.shape == (sum(pages) * 3, page, 2, 8) and k.dtype == torch.float16
    used = torch.zeros(k.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seqlens):
        for pos in range(n):
            used[table[b, pos // page], pos % page] = True
    used = used.to(k.device)
    for cache in (k, v):
        assert cache[used].isfinite().all() and cache[~used].isnan().all()
    assert not torch.equal(k[used], v[used])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU timing path (a GPU times graph replays)")
def test_time_ms_on_the_cpu_is_one_wall_clock_call():
    calls = []
    ms = time_ms(lambda: calls.append(1))
    assert calls == [1] and isinstance(ms, float) and ms >= 0
    with pytest.raises(ValueError, match=r"flush must be one of \('zero', 'read', None\), got 'l2'"):
        time_ms(lambda: None, flush="l2")


@pytest.mark.skipif(ON_GPU, reason="the interpreter's patching")
def test_interpreter_patches_the_language_once_a_launch(monkeypatch):
    """The session installed skip_repeated_interpreter_patching (conftest): a kernel that calls a jit
    helper 5 times patches triton.language once, at its launch, and computes the same."""
    from triton.runtime import interpreter

    assert getattr(interpreter.InterpretedFunction.__call__, "_pagedflash", False)
    assert not skip_repeated_interpreter_patching()  # installed once
    calls = []
    real = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn.__name__) or real(fn))
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    _helper_loop_kernel[(1,)](x, out, N=8)
    assert torch.equal(out, x * 32)
    assert calls == ["_helper_loop_kernel"]


@pytest.mark.skipif(ON_GPU, reason="the interpreter's options")
def test_interpreter_computes_no_overflow_checks(monkeypatch):
    """The session switched off skip_interpreter_overflow_checks's checks (conftest): an int32 add that
    overflows wraps as compiled code does, with no check computed, and debug stays off."""
    from triton.language import semantic
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    assert not options.sanitize_overflow and not options.debug
    assert not skip_interpreter_overflow_checks()  # off already
    checks = []  # a computed check ends in device_assert
    real = semantic.TritonSemantic.device_assert
    monkeypatch.setattr(semantic.TritonSemantic, "device_assert", lambda self, *a: checks.append(1) or real(self, *a))
    x = torch.full((8,), 2**31 - 1, dtype=torch.int32)
    out = torch.empty_like(x)
    _add_one_kernel[(1,)](x, out, N=8)
    assert out.tolist() == [-(2**31)] * 8 and not checks

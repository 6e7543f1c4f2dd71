"""The kept-plan path of ``flash_attn_with_kvcache``: from a signature's second eager call on, the
public function launches the plan kept for its checks itself (:func:`pagedflash.ops.attention.kept_forward`)
instead of going through its operator's launcher. Its results are the first call's and the
operator's, bit for bit; it is skipped where the operator path must run (calls routed through the
dispatcher, new keys appended, a given ``out``), and a new signature gets a new plan."""

import pytest
import torch
from helpers import DEVICE, assert_close, count_kept_launches, make_pool, randn

from pagedflash import flash_attn_with_kvcache
from pagedflash import reference as ref
from pagedflash.ops import attention, custom_ops, decode
from pagedflash.ops.utils import PlanCache


@pytest.fixture
def kept_calls(monkeypatch):
    """The number of kept-plan launches made so far (:func:`helpers.count_kept_launches`)."""
    count, restore = count_kept_launches(monkeypatch, decode)
    yield count
    restore()


def _case(paged: bool, sinks: bool):
    b, hq, hkv, d = 2, 8, 2, 32
    lengths = [37, 5]
    q = randn(b, 1, hq, d)
    if paged:
        k_cache, v_cache, table = make_pool(lengths, 16, hkv, d, torch.float32)
    else:
        k_cache, v_cache, table = randn(b, 48, hkv, d), randn(b, 48, hkv, d), None
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    extra = dict(sinks=randn(hq)) if sinks else {}
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, block_table=table, **extra)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_kept_path_gives_the_first_calls_result_and_the_operators(kept_calls, paged, sinks):
    case = _case(paged, sinks)
    first, first_lse = flash_attn_with_kvcache(**case, num_splits=3, return_lse=True)
    assert kept_calls[0] == 0
    again, again_lse = flash_attn_with_kvcache(**case, num_splits=3, return_lse=True)
    assert kept_calls[0] == 1
    previous = custom_ops.dispatch_eager(True)
    try:
        via_op, via_op_lse = flash_attn_with_kvcache(**case, num_splits=3, return_lse=True)
    finally:
        custom_ops.dispatch_eager(previous)
    assert kept_calls[0] == 1  # routed through the dispatcher: never the kept path
    assert torch.equal(again, first) and torch.equal(again_lse, first_lse)
    assert torch.equal(via_op, first) and torch.equal(via_op_lse, first_lse)
    want, want_lse = ref.kvcache_attention_ref(case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                               block_table=case["block_table"], sinks=case.get("sinks"))
    assert_close(again, want, torch.float32)
    assert_close(again_lse, want_lse, torch.float32, name="lse")


def test_kept_path_only_for_the_same_signature(kept_calls):
    case = _case(False, False)
    flash_attn_with_kvcache(**case)
    flash_attn_with_kvcache(**case, return_lse=True)  # another plan: the LSE is written
    assert kept_calls[0] == 0
    out = flash_attn_with_kvcache(**case)
    assert kept_calls[0] == 1 and out.is_contiguous() and out.shape == case["q"].shape
    # a q of another alignment, another batch: their own first calls
    q_off = randn(2 * 8 * 32 + 1)[1:].view(2, 1, 8, 32)
    flash_attn_with_kvcache(**dict(case, q=q_off))
    flash_attn_with_kvcache(**dict(case, q=case["q"][:1], k_cache=case["k_cache"][:1], v_cache=case["v_cache"][:1],
                                   cache_seqlens=case["cache_seqlens"][:1]))
    assert kept_calls[0] == 1


def test_kept_path_not_for_new_keys_or_a_given_out(kept_calls):
    case = _case(False, False)
    new_k = randn(2, 1, 2, 32)
    for _ in range(2):
        flash_attn_with_kvcache(**case, k=new_k, v=new_k)
        flash_attn_with_kvcache(**case, out=torch.empty_like(case["q"]))
    assert kept_calls[0] == 0


def test_kept_path_after_the_plans_are_cleared(kept_calls):
    """clear_plans forgets the kept plans; the next call makes its plan again (the operator's launcher)."""
    case = _case(True, False)
    first = flash_attn_with_kvcache(**case)
    attention.clear_plans()
    again = flash_attn_with_kvcache(**case)
    assert kept_calls[0] == 0 and torch.equal(again, first)
    assert torch.equal(flash_attn_with_kvcache(**case), first) and kept_calls[0] == 1


def test_plan_cache_find_is_get_and_forgets_on_clear():
    cache = PlanCache(maxsize=2)
    a, b = ("a", 1), ("b", 2)
    assert cache.find(a) is None
    cache.add(a, "A")
    cache.add(b, "B")
    assert cache.find(a) == "A" and cache.find(("a", 1)) == "A" and cache.find(b) == "B"
    cache.clear()
    assert cache.find(b) is None
    cache.add(a, "A")
    assert cache.find(a) == "A"
    cache.add(b, "B")
    cache.add(("c", 3), "C")  # past maxsize: starts over, the last found forgotten with the rest
    assert cache.find(a) is None and cache.find(("c", 3)) == "C"
    for remove in (lambda c, k: c.__delitem__(k), lambda c, k: c.pop(k), lambda c, k: c.popitem()):
        cache.clear()
        cache.add(a, "A")
        assert cache.find(a) == "A"
        remove(cache, a)  # every removal forgets the remembered entry
        assert cache.find(a) is None
    for replace in (lambda c, k: c.add(k, "Z"), lambda c, k: c.update({k: "Z"}), lambda c, k: c.__ior__({k: "Z"})):
        cache.clear()
        cache.add(a, "A")
        assert cache.find(a) == "A"
        replace(cache, a)  # and every replacement
        assert cache.find(a) == "Z"


def test_launches_here_follows_dispatch_eager():
    q = randn(1, 1, 2, 16)
    previous = custom_ops.dispatch_eager(True)
    try:
        assert not custom_ops.launches_here(q)
        custom_ops.dispatch_eager(False)
        assert custom_ops.launches_here(q)
    finally:
        custom_ops.dispatch_eager(previous)

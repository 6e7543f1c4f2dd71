"""The kept-plan path of ``flash_attn_func`` and ``flash_attn_varlen_func``: from a signature's
second eager call on, where the Gluon kernel does not take the call, the public function launches
the plan kept for its checks itself (:func:`pagedflash.ops.attention.kept_forward`) instead of going
through its operator's launcher. Its results are the first call's and the operator's, bit for bit;
it is skipped where the operator path must run (calls routed through the dispatcher, a given
``out``, a call the Gluon kernel takes, asked on every call), and a new signature gets a new plan."""

import pytest
import torch
from helpers import DEVICE, assert_close, count_kept_launches, cu_seqlens, fp8_pool, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func
from pagedflash import reference as ref
from pagedflash.ops import attention, custom_ops, prefill, prefill_hopper


@pytest.fixture
def kept_calls(monkeypatch):
    """The number of kept-plan launches made so far (:func:`helpers.count_kept_launches`)."""
    count, restore = count_kept_launches(monkeypatch, prefill)
    yield count
    restore()


def _case(sinks: bool = False):
    q, k, v = randn(2, 19, 4, 32), randn(2, 21, 2, 32), randn(2, 21, 2, 32)
    return dict(q=q, k=k, v=v, **(dict(sinks=randn(4)) if sinks else {}))


def kept_equals_first_and_dispatched(fn, case: dict, kept_calls: list) -> tuple:
    """``fn(**case)`` three times: the first call keeps its plan, the second takes the kept path, the
    third goes through the dispatcher (never the kept path); all three the same bits. Returns the
    kept call's ``(out, lse)``."""
    first, first_lse = fn(**case)
    assert kept_calls[0] == 0
    again, again_lse = fn(**case)
    assert kept_calls[0] == 1
    previous = custom_ops.dispatch_eager(True)
    try:
        via_op, via_op_lse = fn(**case)
    finally:
        custom_ops.dispatch_eager(previous)
    assert kept_calls[0] == 1
    assert torch.equal(again, first) and torch.equal(again_lse, first_lse)
    assert torch.equal(via_op, first) and torch.equal(via_op_lse, first_lse)
    return again, again_lse


@pytest.mark.parametrize("args", [dict(causal=True), dict(window_size=(5, 2), softcap=3.0, softmax_scale=0.3)],
                         ids=["causal", "window-softcap"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("invariant", [False, True], ids=["", "invariant"])
def test_kept_path_gives_the_first_calls_result_and_the_operators(kept_calls, args, sinks, invariant):
    case = dict(_case(sinks), **args, return_lse=True, batch_invariant=invariant)
    again, again_lse = kept_equals_first_and_dispatched(flash_attn_func, case, kept_calls)
    want, want_lse = ref.attention_ref(case["q"], case["k"], case["v"], sinks=case.get("sinks"), **args)
    assert_close(again, want, torch.float32)
    assert_close(again_lse, want_lse, torch.float32, name="lse")


def test_kept_path_only_for_the_same_signature(kept_calls):
    case = _case()
    flash_attn_func(**case, causal=True)
    flash_attn_func(**case, causal=True, return_lse=True)  # another plan: the LSE is written
    flash_attn_func(**case)  # another check outcome: not causal
    assert kept_calls[0] == 0
    out = flash_attn_func(**case, causal=True)
    assert kept_calls[0] == 1 and out.is_contiguous() and out.shape == case["q"].shape
    # a q of another alignment, another batch: their own first calls
    q_off = randn(2 * 19 * 4 * 32 + 1)[1:].view(2, 19, 4, 32)
    flash_attn_func(**dict(case, q=q_off), causal=True)
    flash_attn_func(q=case["q"][:1], k=case["k"][:1], v=case["v"][:1], causal=True)
    assert kept_calls[0] == 1


def test_kept_call_launches_once(kept_calls, monkeypatch):
    """A kept-plan call launches through the kept plan only: the launcher's attention_forward is not
    called as well (a second launch would give the same bits and go unnoticed otherwise)."""
    case = _case()
    flash_attn_func(**case, causal=True)
    routed = []
    real = prefill.attention_forward
    monkeypatch.setattr(prefill, "attention_forward", lambda *a, **kw: routed.append(1) or real(*a, **kw))
    for n in (1, 2):
        flash_attn_func(**case, causal=True)
        assert kept_calls[0] == n and not routed


def test_kept_path_not_for_a_given_out(kept_calls):
    case = _case()
    for _ in range(2):
        out = torch.empty_like(case["q"])
        assert flash_attn_func(**case, causal=True, out=out) is out
    assert kept_calls[0] == 0


def test_kept_path_after_the_plans_are_cleared(kept_calls):
    """clear_plans forgets the kept plans; the next call makes its plan again (the operator's launcher)."""
    case = _case()
    first = flash_attn_func(**case, causal=True)
    attention.clear_plans()
    again = flash_attn_func(**case, causal=True)
    assert kept_calls[0] == 0 and torch.equal(again, first)
    assert torch.equal(flash_attn_func(**case, causal=True), first) and kept_calls[0] == 1


@pytest.mark.parametrize("how", ["refusal", "enabled"])
def test_the_gluon_kernel_still_takes_a_call_whose_plan_is_kept(kept_calls, monkeypatch, how):
    """The routing is asked on every call, after the portable plan is kept too: a call that the
    Gluon kernel takes (here: its refusal patched away) goes to it, not to the kept plan; with
    PAGEDFLASH_GLUON's switch off again, the kept plan runs."""
    calls = []

    def fake_forward(q, k, v, out, sm_scale, causal, return_lse, invariant=False):
        calls.append((sm_scale, causal, return_lse))
        out.zero_()

    case = _case()
    first = flash_attn_func(**case, causal=True, softmax_scale=0.5)
    flash_attn_func(**case, causal=True, softmax_scale=0.5)
    assert kept_calls[0] == 1 and not calls
    monkeypatch.setattr(prefill_hopper, "forward", fake_forward)
    if how == "refusal":
        monkeypatch.setattr(prefill_hopper, "refusal", lambda *args: "the mode" if args[-1] else None)
    else:  # every other refusal away, the switches decide
        monkeypatch.setattr(prefill_hopper, "_refusal", lambda *args, **kwargs: None)
        monkeypatch.setattr(prefill_hopper, "UNAVAILABLE", None)
        monkeypatch.setattr(prefill_hopper, "ENABLED", True)
    out = flash_attn_func(**case, causal=True, softmax_scale=0.5)
    assert calls == [(0.5, True, False)] and torch.equal(out, torch.zeros_like(out)) and kept_calls[0] == 1
    # batch-invariant calls the Gluon kernel refuses (PAGEDFLASH_INVARIANT_GLUON=0): the kept plan of theirs
    monkeypatch.setattr(prefill_hopper, "INVARIANT_ENABLED", False)
    flash_attn_func(**case, causal=True, softmax_scale=0.5, batch_invariant=True)
    flash_attn_func(**case, causal=True, softmax_scale=0.5, batch_invariant=True)
    assert len(calls) == 1 and kept_calls[0] == 2
    if how == "enabled":
        monkeypatch.setattr(prefill_hopper, "ENABLED", False)
        assert torch.equal(flash_attn_func(**case, causal=True, softmax_scale=0.5), first)
        assert len(calls) == 1 and kept_calls[0] == 3


# ---------------------------------------------------------------- varlen

_LENS_Q, _LENS_K = [7, 1, 4], [9, 12, 4]


def _varlen_case(layout: str) -> dict:
    """Packed K/V (with sinks: "packed-sinks"), a paged cache, or an fp8 paged cache with per-KV-head
    descales; causal."""
    case = dict(q=randn(sum(_LENS_Q), 4, 32), cu_seqlens_q=cu_seqlens(_LENS_Q), cu_seqlens_k=cu_seqlens(_LENS_K),
                max_seqlen_q=max(_LENS_Q), max_seqlen_k=max(_LENS_K), causal=True)
    if layout.startswith("packed"):
        case.update(k=randn(sum(_LENS_K), 2, 32), v=randn(sum(_LENS_K), 2, 32))
        if layout == "packed-sinks":
            case.update(sinks=randn(4))
    elif layout == "paged":
        k, v, table = make_pool(_LENS_K, 4, 2, 32, torch.float32)
        case.update(k=k, v=v, block_table=table)
    else:
        k, v, table = fp8_pool(_LENS_K, 4, 2, 32)
        case.update(k=k, v=v, block_table=table, k_descale=torch.tensor([0.5, 2.0], device=DEVICE),
                    v_descale=torch.tensor([1.5, 0.25], device=DEVICE))
    return case


def _varlen_ref(case: dict):
    k, v = ref.dequantize_ref(case["k"], case.get("k_descale")), ref.dequantize_ref(case["v"], case.get("v_descale"))
    common = dict(causal=True, sinks=case.get("sinks"))
    if "block_table" in case:
        return ref.paged_varlen_attention_ref(case["q"], k, v, case["cu_seqlens_q"], case["cu_seqlens_k"],
                                              case["block_table"], **common)
    return ref.varlen_attention_ref(case["q"], k, v, case["cu_seqlens_q"], case["cu_seqlens_k"], **common)


@pytest.mark.parametrize("layout", ["packed", "packed-sinks", "paged", "paged-fp8"])
@pytest.mark.parametrize("invariant", [False, True], ids=["", "invariant"])
def test_varlen_kept_path_gives_the_first_calls_result_and_the_operators(kept_calls, layout, invariant):
    case = dict(_varlen_case(layout), return_lse=True, batch_invariant=invariant)
    again, again_lse = kept_equals_first_and_dispatched(flash_attn_varlen_func, case, kept_calls)
    want, want_lse = _varlen_ref(case)
    assert_close(again, want, torch.float32)
    assert_close(again_lse, want_lse, torch.float32, name="lse")


def test_varlen_kept_path_only_for_the_same_signature(kept_calls):
    case = _varlen_case("paged")
    flash_attn_varlen_func(**case)
    flash_attn_varlen_func(**case, return_lse=True)  # another plan: the LSE is written
    flash_attn_varlen_func(**dict(case, max_seqlen_k=max(_LENS_K) + 1))  # another check outcome
    flash_attn_varlen_func(**case, num_splits=2)
    assert kept_calls[0] == 0
    out = flash_attn_varlen_func(**case)
    assert kept_calls[0] == 1 and out.is_contiguous() and out.shape == case["q"].shape
    # a q of another alignment, a batch of another size: their own first calls
    q_off = randn(case["q"].numel() + 1)[1:].view(case["q"].shape)
    flash_attn_varlen_func(**dict(case, q=q_off))
    flash_attn_varlen_func(**dict(case, q=case["q"][:7], cu_seqlens_q=case["cu_seqlens_q"][:2],
                                  cu_seqlens_k=case["cu_seqlens_k"][:2], block_table=case["block_table"][:1]))
    assert kept_calls[0] == 1


def test_varlen_kept_call_launches_once_and_not_for_a_given_out(kept_calls, monkeypatch):
    """A kept-plan call launches through the kept plan only (the launcher's attention_forward is not
    called as well); a call with ``out`` never takes it."""
    case = _varlen_case("packed")
    first = flash_attn_varlen_func(**case)
    routed = []
    real = prefill.attention_forward
    monkeypatch.setattr(prefill, "attention_forward", lambda *a, **kw: routed.append(1) or real(*a, **kw))
    for n in (1, 2):
        assert torch.equal(flash_attn_varlen_func(**case), first)
        assert kept_calls[0] == n and not routed
    for _ in range(2):
        out = torch.empty_like(case["q"])
        assert flash_attn_varlen_func(**case, out=out) is out and torch.equal(out, first)
    assert kept_calls[0] == 2 and len(routed) == 2


def test_varlen_kept_path_after_the_plans_are_cleared(kept_calls):
    case = _varlen_case("paged")
    first = flash_attn_varlen_func(**case)
    attention.clear_plans()
    again = flash_attn_varlen_func(**case)
    assert kept_calls[0] == 0 and torch.equal(again, first)
    assert torch.equal(flash_attn_varlen_func(**case), first) and kept_calls[0] == 1


def test_the_gluon_kernel_still_takes_a_varlen_call_whose_plan_is_kept(kept_calls, monkeypatch):
    """As for dense calls: the routing (refusal_varlen) is asked on every call, the launcher told its
    answer, and the kept plan runs again once the Gluon kernel refuses."""
    calls = []

    def fake_forward(q, k, v, out, sm_scale, causal, return_lse, *, varlen, block_table, k_descale, v_descale,
                     invariant=False):
        calls.append((sm_scale, causal, return_lse, varlen[2:], block_table is not None))
        out.zero_()

    case = dict(_varlen_case("paged"), softmax_scale=0.5)
    first = flash_attn_varlen_func(**case)
    flash_attn_varlen_func(**case)
    assert kept_calls[0] == 1 and not calls
    monkeypatch.setattr(prefill_hopper, "forward", fake_forward)
    monkeypatch.setattr(prefill_hopper, "refusal_varlen", lambda *args: "the mode" if args[-1] else None)
    out = flash_attn_varlen_func(**case)
    assert calls == [(0.5, True, False, (max(_LENS_Q), max(_LENS_K)), True)] and kept_calls[0] == 1
    assert torch.equal(out, torch.zeros_like(out))
    flash_attn_varlen_func(**case, batch_invariant=True)  # refused by the Gluon kernel: the portable plan of its own
    flash_attn_varlen_func(**case, batch_invariant=True)
    assert len(calls) == 1 and kept_calls[0] == 2
    monkeypatch.setattr(prefill_hopper, "refusal_varlen", lambda *args: "refused")
    assert torch.equal(flash_attn_varlen_func(**case), first) and len(calls) == 1 and kept_calls[0] == 3

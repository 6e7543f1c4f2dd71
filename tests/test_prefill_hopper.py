"""The Gluon Hopper prefill kernel's routing (pagedflash/ops/prefill_hopper.py), everywhere: which
calls it sends to the portable kernel, with every refusal reason checked on CPU tensors (the device's
capability and the module's availability stubbed), that the dense and varlen entry points (compiled
too) follow it, and that on this machine (no sm90, the interpreter, or another Triton) the portable
kernel runs.

The Gluon path itself on an sm90 GPU: tests/test_prefill_hopper_dense.py, ``_varlen.py`` and
``_paged.py`` (fp8 K/V too); its launch plans: tests/test_prefill_hopper_plans.py; what they share:
tests/prefill_hopper_checks.py.
"""

import prefill_hopper_checks as checks
import pytest
import torch
from helpers import DEVICE, ON_GPU, assert_close, randn
from prefill_hopper_checks import ON_SM90, empty_qkv

from pagedflash import flash_attn_func, flash_attn_varlen_func
from pagedflash import reference as ref
from pagedflash.cache import cu_seqlens_tensor
from pagedflash.ops import launch, prefill_hopper, prefill_hopper_kernel

hopper_here = checks.hopper_here  # the shared fixture, found by its name here


def test_the_measured_cells_are_routed(hopper_here):
    assert prefill_hopper.refusal(*empty_qkv(), -1, -1, 0.0) is None
    assert prefill_hopper.refusal(*empty_qkv(), -1, 0, 0.0) is None  # causal
    assert prefill_hopper.refusal(*empty_qkv(sq=4096, sk=4096, hq=4, hkv=1, d=64, dtype=torch.float16), -1, -1, 0.0) is None
    assert prefill_hopper.refusal(*empty_qkv(sq=1024, sk=4096), -1, 0, 0.0) is None  # causal, Sq < Sk
    assert prefill_hopper.refusal(*empty_qkv(hq=1, hkv=1), -1, 0, 0.0) is None  # D=128: 8 work items on 16 SMs


def test_dense_calls_never_take_fp8_kv(hopper_here):
    # flash_attn_func takes no fp8 K/V; the dense launch has no descales either
    q, k, v = empty_qkv()
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    assert "fp8" in prefill_hopper.refusal(q, k8, v8, -1, 0, 0.0)


def test_batch_invariant_calls_by_the_mode_switch(hopper_here, monkeypatch):
    """The mode's calls take the kernel's invariant variant unless PAGEDFLASH_INVARIANT_GLUON=0, with
    16-bit or fp8 K/V (fp8 unless INVARIANT_FP8 is off) and the mode's own tile (64- or 128-key tiles, 16
    rows a warp of a warpgroup)."""
    q, k, v = empty_qkv()
    monkeypatch.setattr(prefill_hopper, "INVARIANT_ENABLED", False)
    assert "PAGEDFLASH_INVARIANT_GLUON" in prefill_hopper.refusal(q, k, v, -1, 0, 0.0, None, True)
    assert prefill_hopper.refusal(q, k, v, -1, 0, 0.0, None, False) is None
    monkeypatch.setattr(prefill_hopper, "INVARIANT_ENABLED", True)
    assert prefill_hopper.refusal(q, k, v, -1, 0, 0.0, None, True) is None
    k8, v8 = k[0].to(torch.float8_e4m3fn), v[0].to(torch.float8_e4m3fn)
    assert prefill_hopper.refusal_varlen(q[0], k8, v8, 1, 1024, 1024, None, -1, 0, 0.0, None, False) is None
    assert prefill_hopper.refusal_varlen(q[0], k8, v8, 1, 1024, 1024, None, -1, 0, 0.0, None, True) is None
    monkeypatch.setattr(prefill_hopper, "INVARIANT_FP8", False)
    assert "fp8" in prefill_hopper.refusal_varlen(q[0], k8, v8, 1, 1024, 1024, None, -1, 0, 0.0, None, True)
    assert prefill_hopper.refusal_varlen(q[0], k[0], v[0], 1, 1024, 1024, None, -1, 0, 0.0, None, True) is None
    monkeypatch.setattr(launch, "INVARIANT_TILE", "64:128:4:2")  # the variant's other key tile
    assert prefill_hopper.refusal(q, k, v, -1, 0, 0.0, None, True) is None
    assert prefill_hopper_kernel.invariant_block_n(64) == 128
    monkeypatch.setattr(launch, "INVARIANT_TILE", "64:32:4:2")
    assert "tile" in prefill_hopper.refusal(q, k, v, -1, 0, 0.0, None, True)


def _strided(t, pad):
    """``t``'s values in a buffer whose rows are ``pad`` elements longer (same shape, other strides)."""
    return torch.empty(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype)[..., :t.shape[-1]]


REFUSALS = {  # reason: (what the refused call changes, a word of the reason)
    "switched off": (dict(enabled=False), "PAGEDFLASH_GLUON=0"),
    "unavailable": (dict(unavailable="triton 9.9: something"), "triton 9.9"),
    "fp32": (dict(dtype=torch.float32), "dtypes"),
    "head dim 96": (dict(d=96), "head dim 96"),
    "left window": (dict(window=(16, -1)), "window"),
    "right window": (dict(window=(-1, 3)), "window"),
    "softcap": (dict(softcap=30.0), "softcap"),
    "sinks": (dict(sinks=True), "sinks"),
    "not sm90": (dict(capability=(8, 0)), "sm90"),
    "sm100": (dict(capability=(10, 0)), "sm90"),
    "not NVIDIA": (dict(capability=None), "sm90"),
    "causal Sq > Sk": (dict(sq=2048, window=(-1, 0)), "Sq > Sk"),
    "no keys": (dict(sk=0), "no keys"),
    "short": (dict(sq=128, sk=128), "measured"),
    "short keys": (dict(sk=128), "measured"),
    "D=64 short": (dict(d=64, sq=128, sk=128), "measured"),
    "few work items": (dict(hq=1, hkv=1, sq=512), "work items"),  # 4 on 16 SMs
    "D=64 few work items": (dict(d=64, hq=1, hkv=1), "work items"),  # 8 on 16 SMs
    "misaligned": (dict(offset=1), "16-byte"),
    "row stride": (dict(pad=4), "16-byte"),
}


@pytest.mark.parametrize("case", REFUSALS, ids=str)
def test_each_refusal_keeps_the_portable_kernel(hopper_here, monkeypatch, case):
    change, word = REFUSALS[case]
    if "enabled" in change:
        monkeypatch.setattr(prefill_hopper, "ENABLED", change["enabled"])
    if "unavailable" in change:
        monkeypatch.setattr(prefill_hopper, "UNAVAILABLE", change["unavailable"])
    if "capability" in change:
        monkeypatch.setattr(prefill_hopper, "nvidia_capability", lambda device: change["capability"])
    shape = {key: change[key] for key in ("sq", "sk", "hq", "hkv", "d", "dtype") if key in change}
    q, k, v = empty_qkv(**shape)
    if "offset" in change:
        q = torch.empty(q.numel() + 8, dtype=q.dtype)[change["offset"]:q.numel() + change["offset"]].view(q.shape)
    if "pad" in change:
        k = _strided(k, change["pad"])
    left, right = change.get("window", (-1, -1))
    sinks = torch.zeros(q.shape[2]) if change.get("sinks") else None
    reason = prefill_hopper.refusal(q, k, v, left, right, change.get("softcap", 0.0), sinks)
    assert reason is not None and word in reason


def test_the_size_rule_is_the_measured_table():
    # every head dim from 256 keys and queries, causal or not (v22: the persistent kernel; shorter
    # lengths not measured)
    assert prefill_hopper.MIN_SEQLEN == {(128, False): 256, (128, True): 256, (64, False): 256, (64, True): 256}
    # launches of fewer work items than SMs (v25: 128 and 64 items on 132 SMs)
    assert prefill_hopper.MIN_PROGRAMS_PER_SM == {128: 0.45, 64: 0.95}
    assert set(prefill_hopper.MIN_PROGRAMS_PER_SM) == {d for d, _ in prefill_hopper.MIN_SEQLEN}


@pytest.mark.parametrize("d, sq, routed", [(128, 896, False), (128, 1024, True), (64, 1920, False), (64, 2048, True)])
def test_the_fewest_work_items_by_head_dim(hopper_here, d, sq, routed):
    # one head on 16 SMs: 7 / 8 items at D=128 (bar 7.2), 15 / 16 at D=64 (bar 15.2)
    reason = prefill_hopper.refusal(*empty_qkv(sq=sq, sk=sq, hq=1, hkv=1, d=d), -1, -1, 0.0)
    assert (reason is None) if routed else "work items" in reason, reason


@pytest.mark.parametrize("routed", [True, False], ids=["gluon", "portable"])
def test_the_dense_entry_point_follows_the_routing(monkeypatch, routed):
    calls = []

    def fake_forward(q, k, v, out, sm_scale, causal, return_lse, invariant=False):
        calls.append((sm_scale, causal, return_lse))
        out.zero_()
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device) if return_lse else None

    monkeypatch.setattr(prefill_hopper, "refusal", lambda *args: None if routed else "a reason")
    monkeypatch.setattr(prefill_hopper, "forward", fake_forward)
    q, k, v = randn(1, 9, 2, 16), randn(1, 11, 1, 16), randn(1, 11, 1, 16)
    out, lse = flash_attn_func(q, k, v, causal=True, softmax_scale=0.5, return_lse=True)
    if routed:
        assert calls == [(0.5, True, True)] and torch.equal(out, torch.zeros_like(out))
    else:
        assert calls == []
        assert_close(out, ref.attention_ref(q, k, v, causal=True, softmax_scale=0.5)[0], torch.float32)


@pytest.mark.parametrize("routed", [True, False])
def test_the_varlen_entry_point_follows_the_routing(monkeypatch, routed):
    calls = []

    def fake_forward(q, k, v, out, sm_scale, causal, return_lse, varlen, block_table, k_descale, v_descale,
                     invariant=False):
        calls.append((sm_scale, causal, return_lse, varlen[2:], k_descale, v_descale))
        out.zero_()
        return torch.zeros(q.shape[1], q.shape[0], device=q.device) if return_lse else None

    monkeypatch.setattr(prefill_hopper, "refusal_varlen", lambda *args: None if routed else "a reason")
    monkeypatch.setattr(prefill_hopper, "forward", fake_forward)
    cu = cu_seqlens_tensor([9, 11], device=DEVICE)
    q, k, v = randn(20, 2, 16), randn(20, 1, 16), randn(20, 1, 16)
    out, lse = flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True, softmax_scale=0.5, return_lse=True)
    if routed:
        assert calls == [(0.5, True, True, (11, 11), None, None)] and torch.equal(out, torch.zeros_like(out))
    else:
        assert calls == []
        assert_close(out, ref.varlen_attention_ref(q, k, v, cu, cu, causal=True, softmax_scale=0.5)[0],
                     torch.float32)


def test_a_compiled_call_follows_the_routing_too(monkeypatch):
    # the routing lives in the operator body, which torch.compile's graph calls
    calls = []

    def fake_forward(q, k, v, out, sm_scale, causal, return_lse, invariant=False):
        calls.append(causal)
        out.fill_(1.0)

    monkeypatch.setattr(prefill_hopper, "refusal", lambda *args: None)
    monkeypatch.setattr(prefill_hopper, "forward", fake_forward)
    q, k, v = randn(1, 5, 2, 16), randn(1, 7, 1, 16), randn(1, 7, 1, 16)
    # out made outside the graph: dynamo refuses the suite's poisoned torch.empty, or the real one once
    # its rules were built while the poisoned one was in place (which depends on the test order)
    out = torch.zeros_like(q)
    torch.compile(lambda q, k, v, out: flash_attn_func(q, k, v, causal=True, out=out), fullgraph=True,
                  backend="aot_eager")(q, k, v, out)
    assert calls == [True] and torch.equal(out, torch.ones_like(out))


@pytest.mark.skipif(ON_SM90, reason="checks the machines without the Gluon path")
def test_the_portable_kernel_runs_here():
    # this machine (no sm90 GPU, or the interpreter, or a Triton other than 3.6) never routes
    q, k, v = randn(1, 33, 2, 64, dtype=torch.float16), randn(1, 40, 2, 64, dtype=torch.float16), \
        randn(1, 40, 2, 64, dtype=torch.float16)
    assert prefill_hopper.refusal(q, k, v, -1, 0, 0.0) is not None
    before = prefill_hopper.launches
    out = flash_attn_func(q, k, v, causal=True)
    assert prefill_hopper.launches == before
    assert_close(out, ref.attention_ref(q, k, v, causal=True)[0], torch.float16)


@pytest.mark.skipif(ON_GPU, reason="checks the interpreter")
def test_unavailable_under_the_interpreter():
    assert prefill_hopper.UNAVAILABLE and "interpreter" in prefill_hopper.UNAVAILABLE


def test_lengths_and_sizes_at_the_rules_edges(hopper_here):
    assert prefill_hopper.refusal(*empty_qkv(b=16, sq=256, sk=256), -1, 0, 0.0) is None
    assert "measured" in prefill_hopper.refusal(*empty_qkv(b=16, sq=255, sk=256), -1, -1, 0.0)
    # a program's ring index is int32: 1M rows of a Llama-3-8B layer fit, 16M rows of 2 heads do not
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, kv = torch.empty(1, 2**20, 32, 128, **meta), torch.empty(1, 2**20, 8, 128, **meta)
    assert prefill_hopper.refusal(q, kv, kv, -1, 0, 0.0) is None
    q, kv = torch.empty(1, 2**24, 2, 128, **meta), torch.empty(1, 2**24, 2, 128, **meta)
    assert "int32" in prefill_hopper.refusal(q, kv, kv, -1, 0, 0.0)


def _packed(lens_q, lens_k, hq=4, hkv=2, d=128, dtype=torch.bfloat16):
    """Uninitialized packed q/k/v and their cu_seqlens (CPU)."""
    cu_q, cu_k = cu_seqlens_tensor(lens_q, device="cpu"), cu_seqlens_tensor(lens_k, device="cpu")
    return (torch.empty(int(cu_q[-1]), hq, d, dtype=dtype), torch.empty(int(cu_k[-1]), hkv, d, dtype=dtype),
            torch.empty(int(cu_k[-1]), hkv, d, dtype=dtype), cu_q, cu_k)


def test_varlen_routing(hopper_here):
    q, k, v, cu_q, cu_k = _packed([1024, 300, 700], [1024, 300, 900])
    args = (q, k, v, 3, 1024, 1024)
    assert prefill_hopper.refusal_varlen(*args, None, -1, 0, 0.0) is None
    assert prefill_hopper.refusal_varlen(*args, None, -1, -1, 0.0) is None
    # the queries of the sequences other than the longest meet the size rule: a serving step of one
    # prompt's chunk and decode rows stays portable, one of several prompts' chunks does not
    assert "measured" in prefill_hopper.refusal_varlen(q[:700], k, v, 3, 698, 1024, None, -1, 0, 0.0)
    step = torch.empty(2048 + 7, 4, 128, dtype=torch.bfloat16)  # a 2048-row chunk and 7 decode rows
    assert "measured" in prefill_hopper.refusal_varlen(step, k, v, 8, 2048, 1024, None, -1, 0, 0.0)
    assert prefill_hopper.refusal_varlen(q[:1536], k, v, 3, 1024, 1024, None, -1, 0, 0.0) is None
    assert prefill_hopper.refusal_varlen(q[:1024], k, v, 1, 1024, 1024, None, -1, 0, 0.0) is None
    assert "measured" in prefill_hopper.refusal_varlen(q, k, v, 3, 1024, 200, None, -1, 0, 0.0)
    assert "window" in prefill_hopper.refusal_varlen(*args, None, 64, 0, 0.0)
    assert "dtypes" in prefill_hopper.refusal_varlen(q, k.to(torch.float8_e4m3fn), v, 3, 1024, 1024, None, -1, 0, 0.0)
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):  # fp8 K/V: the convert partition's launch
        assert prefill_hopper.refusal_varlen(q, k.to(fp8), v.to(fp8), 3, 1024, 1024, None, -1, 0, 0.0) is None
    assert "dtypes" in prefill_hopper.refusal_varlen(q.float(), k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn),
                                                     3, 1024, 1024, None, -1, 0, 0.0)


def test_paged_routing(hopper_here):
    q = torch.empty(2048, 4, 128, dtype=torch.bfloat16)
    for page in (16, 32, 64, 128, 256, 384):
        cache = torch.empty(64, page, 2, 128, dtype=torch.bfloat16)
        table = torch.zeros(2, 4096 // page, dtype=torch.int32)
        assert prefill_hopper.refusal_varlen(q, cache, cache, 2, 1024, 4096, table, -1, 0, 0.0) is None, page
    for page, why in ((1, "page size 1"), (8, "page size 8"), (48, "page size 48"), (200, "page size 200")):
        cache = torch.empty(64, page, 2, 128, dtype=torch.bfloat16)
        table = torch.zeros(2, 4096 // page + 1, dtype=torch.int32)
        assert why in prefill_hopper.refusal_varlen(q, cache, cache, 2, 1024, 4096, table, -1, 0, 0.0)
    strided = torch.empty(64, 64, 2, 136, dtype=torch.bfloat16)[..., :128]  # rows of 272 B: TMA takes them
    table = torch.zeros(2, 64, dtype=torch.int32)
    assert prefill_hopper.refusal_varlen(q, strided, strided, 2, 1024, 4096, table, -1, 0, 0.0) is None
    odd = torch.empty(64, 64, 2, 132, dtype=torch.bfloat16)[..., :128]  # rows of 264 B: not 16-byte multiples
    assert "strides" in prefill_hopper.refusal_varlen(q, odd, odd, 2, 1024, 4096, table, -1, 0, 0.0)
    for page in (16, 32, 64, 256):  # fp8 pools: the bf16 pools' page sizes
        fp8 = torch.empty(64, page, 2, 128, dtype=torch.float8_e4m3fn)
        table = torch.zeros(2, 4096 // page, dtype=torch.int32)
        assert prefill_hopper.refusal_varlen(q, fp8, fp8, 2, 1024, 4096, table, -1, 0, 0.0) is None, page
    table = torch.zeros(2, 64, dtype=torch.int32)
    odd = torch.empty(64, 64, 2, 136, dtype=torch.float8_e4m3fn)[..., :128]  # rows of 136 B: not 16-byte multiples
    assert "strides" in prefill_hopper.refusal_varlen(q, odd, odd, 2, 1024, 4096, table, -1, 0, 0.0)
    cache = torch.empty(64, 64, 2, 128, dtype=torch.bfloat16)
    assert "window" in prefill_hopper.refusal_varlen(q, cache, cache, 2, 1024, 4096, table, 128, 0, 0.0)
    assert "softcap" in prefill_hopper.refusal_varlen(q, cache, cache, 2, 1024, 4096, table, -1, 0, 30.0)

"""The Gluon Hopper prefill kernel (pagedflash/ops/prefill_hopper.py) and its routing.

Everywhere: which calls the routing sends to the portable kernel, with every refusal reason checked
on CPU tensors (the device's capability and the module's availability stubbed), that the dense
entry point follows the routing, that a compile failure warns and falls back, and that on this
machine (no sm90, the interpreter, or another Triton) the portable kernel runs. On an sm90 GPU
(``@pytest.mark.gpu``): the Gluon path itself against the fp32 reference (fp16/bf16, D 64/128,
causal or not, GQA, Sq < Sk, odd lengths, ragged last tiles in several sequences, NaN past each
sequence, strided inputs, ``out=``, LSE, a CUDA graph, torch.compile; varlen and paged, over fp8 K/V
too, against the reference over the dequantized values), with the launch counter
proving the Gluon kernel ran; the shapes are small, so the measured-size rule is lifted for them.
"""

import pytest
import torch
from helpers import DEVICE, ON_GPU, assert_close, cu_seqlens, fp8_pool, ids, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func
from pagedflash import reference as ref
from pagedflash.cache import cu_seqlens_tensor
from pagedflash.ops import prefill_hopper
from pagedflash.ops.utils import nvidia_capability
from pagedflash.testing import capture_graph

ON_SM90 = ON_GPU and nvidia_capability(torch.device("cuda")) == (9, 0)
sm90 = pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on NVIDIA sm90 only")


# ------------------------------------------------------------------------------------------ routing
@pytest.fixture
def hopper_here(monkeypatch):
    """The routing as on an sm90 GPU with Triton 3.6, over CPU tensors (no launch happens)."""
    monkeypatch.setattr(prefill_hopper, "ENABLED", True)
    monkeypatch.setattr(prefill_hopper, "UNAVAILABLE", None)
    monkeypatch.setattr(prefill_hopper, "nvidia_capability", lambda device: (9, 0))
    monkeypatch.setattr(prefill_hopper, "num_sms", lambda device: 16)


def _qkv(b=1, sq=1024, sk=1024, hq=2, hkv=2, d=128, dtype=torch.bfloat16):
    """Uninitialized operands of a call the routing accepts as they are (16 programs, 16 SMs)."""
    return (torch.empty(b, sq, hq, d, dtype=dtype), torch.empty(b, sk, hkv, d, dtype=dtype),
            torch.empty(b, sk, hkv, d, dtype=dtype))


def test_the_measured_cells_are_routed(hopper_here):
    assert prefill_hopper.refusal(*_qkv(), -1, -1, 0.0) is None
    assert prefill_hopper.refusal(*_qkv(), -1, 0, 0.0) is None  # causal
    assert prefill_hopper.refusal(*_qkv(sq=4096, sk=4096, hq=4, hkv=1, d=64, dtype=torch.float16), -1, -1, 0.0) is None
    assert prefill_hopper.refusal(*_qkv(sq=1024, sk=4096), -1, 0, 0.0) is None  # causal, Sq < Sk
    assert prefill_hopper.refusal(*_qkv(hq=1, hkv=1), -1, 0, 0.0) is None  # D=128: 8 work items on 16 SMs


def test_dense_calls_never_take_fp8_kv(hopper_here):
    # flash_attn_func takes no fp8 K/V; the dense launch has no descales either
    q, k, v = _qkv()
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    assert "fp8" in prefill_hopper.refusal(q, k8, v8, -1, 0, 0.0)


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
    q, k, v = _qkv(**shape)
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
    reason = prefill_hopper.refusal(*_qkv(sq=sq, sk=sq, hq=1, hkv=1, d=d), -1, -1, 0.0)
    assert (reason is None) if routed else "work items" in reason, reason


@pytest.mark.parametrize("routed", [True, False], ids=["gluon", "portable"])
def test_the_dense_entry_point_follows_the_routing(monkeypatch, routed):
    calls = []

    def fake_forward(q, k, v, out, sm_scale, causal, return_lse):
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

    def fake_forward(q, k, v, out, sm_scale, causal, return_lse, varlen, block_table, k_descale, v_descale):
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


@pytest.mark.parametrize("sq, sk, heads", [(1024, 1024, 256), (2048, 2048, 128), (16384, 16384, 16),
                                           (32768, 32768, 16), (65536, 65536, 8), (6144, 6144, 16),
                                           (12288, 12288, 16), (700, 700, 12 * 40), (1000, 3000, 64)])
def test_causal_programs_share_the_key_tiles_evenly(sq, sk, heads):
    # the persistent grid's program count, scored here with the kernel's deal (round r: item
    # r * p + pid, or r * p + p - 1 - pid in odd rounds) and its key tiles (bottom-right causal): the
    # busiest program within 5 % and one item of an even share of all 132 SMs
    n_m = -(-sq // prefill_hopper.BLOCK_M)
    n_items = n_m * heads
    p = prefill_hopper.programs(n_items, n_m, True, 132, sq, sk)
    assert 0.85 * 132 <= p <= 132
    t = torch.arange(n_items)
    pid = torch.where(t // p % 2 == 0, t % p, p - 1 - t % p)
    m0 = (n_m - 1 - t % n_m) * prefill_hopper.BLOCK_M
    tiles = torch.clamp((m0 + prefill_hopper.BLOCK_M + sk - sq + 127) // 128, max=-(-sk // 128)).double()
    load = torch.bincount(pid, weights=tiles, minlength=p)
    assert load.max() <= 1.05 * tiles.sum() / 132 + tiles.max(), (p, load.max().item(), tiles.sum().item() / 132)
    assert prefill_hopper.programs(n_items, n_m, False, 132, sq, sk) == 132
    assert prefill_hopper.programs(100, n_m, True, 132, sq, sk) == 100
    assert all(1 <= prefill_hopper.programs(n_items, n_m, True, sms, sq, sk) <= sms for sms in (1, 2, 5))


def test_lengths_and_sizes_at_the_rules_edges(hopper_here):
    assert prefill_hopper.refusal(*_qkv(b=16, sq=256, sk=256), -1, 0, 0.0) is None
    assert "measured" in prefill_hopper.refusal(*_qkv(b=16, sq=255, sk=256), -1, -1, 0.0)
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


def _plan_ints(q, k, varlen=None, block_table=None, causal=True):
    return prefill_hopper._make_plan(q, k, k, torch.empty_like(q), causal, False, varlen, block_table, None, None).ints


def _compile_classes(ints):
    """What Triton specializes an integer argument on: equal to 1, a multiple of 16, other."""
    return {name: (x == 1, x % 16 == 0) for name, x in ints.items() if name not in prefill_hopper.kernel.RUNTIME_INTS}


def test_what_varies_between_serving_steps_never_recompiles_the_kernel(hopper_here, monkeypatch):
    # two chunked-prefill steps of one engine (paged), two varlen calls, two dense calls of another
    # length and batch: every integer argument either stays in its class or is never specialized
    monkeypatch.setattr(prefill_hopper.kernel, "kernel_config", lambda *args: ({}, {}, None, None, None, None))
    cache, bf16 = torch.empty(512, 16, 8, 128, dtype=torch.bfloat16), torch.bfloat16
    step1 = _plan_ints(torch.empty(512, 32, 128, dtype=bf16), cache, (1, 512, 4096),
                       torch.zeros(1, 256, dtype=torch.int32))
    step2 = _plan_ints(torch.empty(307, 32, 128, dtype=bf16), cache, (2, 300, 1001),
                       torch.zeros(2, 63, dtype=torch.int32))
    assert step1 != step2 and _compile_classes(step1) == _compile_classes(step2)
    packed = torch.empty(5000, 8, 128, dtype=bf16)
    assert _compile_classes(_plan_ints(packed[:4096], packed, (4, 1024, 1024))) == \
        _compile_classes(_plan_ints(packed[:3001], packed, (3, 1700, 2001)))
    assert _compile_classes(_plan_ints(*_qkv(b=2, sq=1024, sk=1024)[:2])) == \
        _compile_classes(_plan_ints(*_qkv(b=1, sq=777, sk=1001)[:2]))


class _FakeCompileError(RuntimeError):
    pass


def test_a_compile_failure_warns_once_and_takes_the_portable_kernel(monkeypatch):
    tried = []

    class Failing:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                tried.append(grid)
                raise _FakeCompileError("ptxas died")
            return run

    monkeypatch.setattr(prefill_hopper.kernel, "prefill_kernel", Failing(), raising=False)
    monkeypatch.setattr(prefill_hopper.kernel, "TensorDescriptor", lambda *args: None, raising=False)
    monkeypatch.setattr(prefill_hopper.kernel, "kernel_config", lambda *args: ({}, {}, None, None, None, None))
    monkeypatch.setattr(prefill_hopper.kernel, "COMPILE_ERRORS", (_FakeCompileError,), raising=False)
    monkeypatch.setattr(prefill_hopper, "_PLANS", type(prefill_hopper._PLANS)())
    monkeypatch.setattr(prefill_hopper, "refusal", lambda *args: None)  # routed here, whatever the machine
    q, k, v = randn(1, 20, 2, 32), randn(1, 20, 2, 32), randn(1, 20, 2, 32)
    want = ref.attention_ref(q, k, v, causal=True)
    with pytest.warns(UserWarning, match="Gluon prefill kernel failed to compile .*_FakeCompileError"):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert_close(out, want[0], torch.float32)
    assert_close(lse, want[1], torch.float32, name="lse")
    out, _ = flash_attn_func(q, k, v, causal=True, return_lse=True)  # remembered: the portable kernel at once
    assert_close(out, want[0], torch.float32)
    assert len(tried) == 1


# ------------------------------------------------------------------------------------------ sm90
@pytest.fixture
def gluon(monkeypatch):
    """Route the small test shapes to the Gluon kernel (those rules are about speed, not results)."""
    monkeypatch.setattr(prefill_hopper, "ENABLED", True)
    monkeypatch.setattr(prefill_hopper, "MIN_SEQLEN", dict.fromkeys(prefill_hopper.MIN_SEQLEN, 0))
    monkeypatch.setattr(prefill_hopper, "MIN_PROGRAMS_PER_SM", dict.fromkeys(prefill_hopper.MIN_PROGRAMS_PER_SM, 0))


def _check_gluon(q, k, v, dtype, out=None, **opts):
    """One call that must take the Gluon kernel, against the fp32 reference (out and LSE)."""
    reason = prefill_hopper.refusal(q, k, v, -1, 0 if opts.get("causal") else -1, 0.0)
    assert reason is None, reason
    before = prefill_hopper.launches
    got, lse = flash_attn_func(q, k, v, return_lse=True, out=out, **opts)
    assert prefill_hopper.launches == before + 1, "the Gluon kernel did not run"
    want, want_lse = ref.attention_ref(q, k, v, **opts)
    assert got.dtype == dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_close(got, want, dtype)
    assert_close(lse, want_lse, torch.float16, name="lse")
    return got


SHAPES = [  # (B, Sq, Sk, Hq, Hkv): one tile, ragged tails in several sequences, GQA/MQA, Sq < Sk, odd sizes
    (2, 256, 256, 4, 4), (2, 1000, 1000, 4, 2), (1, 4097, 4097, 2, 1), (3, 77, 77, 2, 1), (2, 300, 1000, 4, 1),
    (2, 130, 130, 8, 2), (1, 1, 129, 2, 2),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gluon_against_reference(gluon, dtype, d, causal, shape):
    b, sq, sk, hq, hkv = shape
    q, k, v = randn(b, sq, hq, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype)
    _check_gluon(q, k, v, dtype, causal=causal)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("programs", [1, 2, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_persistent_programs_take_many_items(gluon, monkeypatch, programs, causal, d):
    # a grid of fewer programs than work items: each program's items differ in key tiles (causal),
    # sequences and heads, so the K/V ring's index and the Q slots' phases run on across items,
    # through rounds taken in both directions
    monkeypatch.setattr(prefill_hopper, "num_sms", lambda device: programs)
    monkeypatch.setattr(prefill_hopper, "_PLANS", type(prefill_hopper._PLANS)())
    dtype = torch.bfloat16
    # 72 items; 12 (Sq < Sk); 18 (5 programs: an odd, partial last round); 16 one-tile items
    for b, sq, sk, hq, hkv in ((3, 700, 700, 4, 2), (2, 300, 1000, 2, 1), (1, 700, 700, 3, 1), (4, 100, 100, 4, 2)):
        q, k, v = randn(b, sq, hq, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype)
        _check_gluon(q, k, v, dtype, causal=causal)


def _through_gluon(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, return_lse, block_table=None, out=None,
                   k_descale=None, v_descale=None):
    """A :func:`flash_attn_varlen_func` call that the routing must send to the Gluon kernel, and does:
    ``(out, lse)`` (lse None without ``return_lse``)."""
    args = (q, k, v, cu_q.shape[0] - 1, max_q, max_k, block_table, -1, 0 if causal else -1, 0.0)
    assert prefill_hopper.refusal_varlen(*args) is None, prefill_hopper.refusal_varlen(*args)
    before = prefill_hopper.launches
    got = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, block_table=block_table,
                                 return_lse=return_lse, out=out, k_descale=k_descale, v_descale=v_descale)
    assert prefill_hopper.launches == before + 1, "the Gluon kernel did not run"
    return got if return_lse else (got, None)


def _check_varlen(lens_q, lens_k, hq, hkv, d, dtype, causal, poison_last_v=False, return_lse=True, fused=False):
    """A varlen call that must take the Gluon kernel, against the fp32 reference (out and LSE);
    with ``poison_last_v`` the last sequence's V is inf and only the others are compared; ``fused``:
    q/k/v views of one packed qkv buffer (token strides past one tensor's heads) and a strided out."""
    cu_q, cu_k = cu_seqlens_tensor(lens_q, device="cuda"), cu_seqlens_tensor(lens_k, device="cuda")
    out = None
    if fused:  # self-attention shapes: one buffer [T, Hq + 2 Hkv, D]
        assert lens_q == lens_k
        qkv = randn(int(cu_q[-1]), hq + 2 * hkv, d, dtype=dtype)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        out = torch.full((int(cu_q[-1]), hq, d + 8), float("nan"), dtype=dtype, device="cuda")[..., :d]
    else:
        q, k, v = randn(int(cu_q[-1]), hq, d, dtype=dtype), randn(int(cu_k[-1]), hkv, d, dtype=dtype), \
            randn(int(cu_k[-1]), hkv, d, dtype=dtype)
    if poison_last_v:
        v[int(cu_k[-2]):] = float("inf")
    got, lse = _through_gluon(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, return_lse=return_lse,
                              out=out)
    assert out is None or got is out
    want, want_lse = ref.varlen_attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    rows = int(cu_q[-2]) if poison_last_v else q.shape[0]
    assert_close(got[:rows], want[:rows], dtype)
    if return_lse:
        assert_close(lse[:, :rows], want_lse[:, :rows], torch.float16, name="lse")


VARLEN_CASES = [  # (lengths of q, lengths of k): ragged tails, an empty sequence, Sq < Sk, Sq > Sk (causal: rows
    # that see no key), one sequence
    ([300, 1000, 77], [300, 1000, 77]), ([128, 0, 513], [128, 0, 513]), ([200, 300], [700, 900]),
    ([500, 130], [200, 0]), ([1000], [1000]),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", VARLEN_CASES, ids=str)
def test_gluon_varlen_against_reference(gluon, dtype, d, causal, lens):
    _check_varlen(*lens, 4, 2, d, dtype, causal)
    _check_varlen(*lens, 4, 2, d, dtype, causal, return_lse=False)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_varlen_fused_qkv_and_strided_out(gluon, causal):
    _check_varlen([300, 1000, 77], [300, 1000, 77], 4, 2, 128, torch.float16, causal, fused=True)


@pytest.mark.gpu
@sm90
def test_gluon_varlen_in_a_cuda_graph_with_new_lengths(gluon):
    # the descriptors are made in the kernel, so a replay follows the cu_seqlens it finds
    dtype, total = torch.bfloat16, 1400
    q, k, v = randn(total, 4, 128, dtype=dtype), randn(total, 2, 128, dtype=dtype), randn(total, 2, 128, dtype=dtype)
    cu = torch.tensor([0, 300, 1300, total], dtype=torch.int32, device="cuda")
    before = prefill_hopper.launches
    graph, out = capture_graph(lambda: flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, causal=True))
    assert prefill_hopper.launches == before + 2  # the warm-up call and the captured one
    for lengths in ([0, 1000, 1077, total], [0, 1, 700, total]):
        cu.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, ref.varlen_attention_ref(q, k, v, cu, cu, causal=True)[0], dtype)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_varlen_few_programs_and_a_poisoned_neighbour(gluon, monkeypatch, programs, causal):
    # many items a program (the descriptors are rewritten item after item) and inf in the last
    # sequence's V, which no other sequence may see
    monkeypatch.setattr(prefill_hopper, "num_sms", lambda device: programs)
    monkeypatch.setattr(prefill_hopper, "_PLANS", type(prefill_hopper._PLANS)())
    _check_varlen([300, 1000, 77, 129], [300, 1000, 77, 129], 4, 1, 128, torch.bfloat16, causal, poison_last_v=True)
    _check_varlen([100, 0, 130, 40], [300, 5, 130, 0], 2, 2, 64, torch.bfloat16, causal)


def _descales(kind, hkv):
    """fp8 descales: None, one for all heads (``[]``), or one per KV head (``[Hkv]``, a strided view)."""
    if kind is None:
        return None, None
    if kind == "tensor":
        return torch.tensor(0.75, device="cuda"), torch.tensor(1.5, device="cuda")
    if kind == "one":  # [1]: one for all heads too (a plan of its own beside [Hkv]'s)
        return torch.tensor([1.25], device="cuda"), torch.tensor([0.5], device="cuda")
    scales = torch.rand(2, hkv, 2, device="cuda") + 0.5
    return scales[0, :, 0], scales[1, :, 1]


def _check_paged(lens_q, lens_k, page, hq, hkv, d, dtype, causal, share_first=0, return_lse=True, odd=False,
                 fp8=None, descale=None):
    """A varlen call over a NaN-poisoned paged pool (:func:`helpers.make_pool`: pages in random order,
    every slot past a sequence's keys NaN) that must take the Gluon kernel, against the reference.
    ``odd``: the caches are the first D columns of wider rows (token strides past ``Hkv * D``) and
    the block table the first columns of a wider one (its row stride past its width). ``fp8``: the
    pool in that dtype (NaN in fp8 too), with ``descale`` (:func:`_descales`), against the reference
    over the dequantized pool."""
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    if fp8 is None:
        k_cache, v_cache, table = make_pool(lens_k, page, hkv, d, dtype, share_first=share_first)
    else:
        k_cache, v_cache, table = fp8_pool(lens_k, page, hkv, d, fp8, share_first=share_first)
    kd, vd = _descales(descale, hkv)
    if odd:
        k_cache, v_cache = (torch.nn.functional.pad(c, (0, 8), value=float("nan"))[..., :d] for c in (k_cache, v_cache))
        wide = torch.full((table.shape[0], table.shape[1] + 5), -7, dtype=torch.int32, device=table.device)
        wide[:, :table.shape[1]] = table
        table = wide[:, :table.shape[1]]
    q = randn(int(cu_q[-1]), hq, d, dtype=dtype)
    got, lse = _through_gluon(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                              block_table=table, return_lse=return_lse, k_descale=kd, v_descale=vd)
    want, want_lse = ref.paged_varlen_attention_ref(q, ref.dequantize_ref(k_cache, kd), ref.dequantize_ref(v_cache, vd),
                                                    cu_q, cu_k, table, causal=causal)
    assert_close(got, want, dtype)
    if return_lse:
        assert_close(lse, want_lse, torch.float16, name="lse")


PAGED_CASES = [  # (lengths of q, lengths of k): chunks over a cached prefix (Sq < Sk) ending mid-page, on a
    # page's end, on a key tile's end and one row into a tile; a whole prompt; an empty chunk; no keys
    ([300, 100, 1], [1300, 320, 129]), ([256, 64], [512, 4096]), ([513], [513]), ([0, 200], [50, 700]),
    ([130, 40], [130, 0]),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("lens", PAGED_CASES, ids=str)
def test_gluon_paged_against_reference(gluon, dtype, d, causal, page, lens):
    _check_paged(*lens, page, 4, 2, d, dtype, causal)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("page", [32, 128])
def test_gluon_paged_few_programs_and_a_shared_prefix(gluon, monkeypatch, programs, page):
    # many items a program, each rewriting its last page's descriptors; every sequence's first pages
    # are the first sequence's (prefix caching)
    monkeypatch.setattr(prefill_hopper, "num_sms", lambda device: programs)
    monkeypatch.setattr(prefill_hopper, "_PLANS", type(prefill_hopper._PLANS)())
    _check_paged([200, 300, 77, 129], [1000, 700, 400, 129], page, 4, 1, 128, torch.bfloat16, True, share_first=1)
    _check_paged([200, 300, 77, 129], [1000, 700, 400, 129], page, 2, 2, 64, torch.bfloat16, False)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("page", [16, 128, 384])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_paged_strided_caches_and_table_without_lse(gluon, page, causal):
    # wider rows than Hkv * D in the caches (the host and the device descriptors take the token
    # stride), a block table narrower than its rows, no LSE; a page of 384 rows (3 key tiles a page)
    _check_paged([300, 100, 1], [1300, 320, 129], page, 4, 2, 128, torch.bfloat16, causal, return_lse=False,
                 odd=True)


FP8_CASES = [  # (fp8 dtype, descales)
    (torch.float8_e4m3fn, None), (torch.float8_e4m3fn, "tensor"), (torch.float8_e4m3fn, "head"),
    (torch.float8_e5m2, "head"), (torch.float8_e4m3fn, "one"), (torch.float8_e5m2, None),
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("lens", PAGED_CASES[:3], ids=str)
def test_gluon_paged_fp8_against_reference(gluon, dtype, d, causal, page, lens):
    # fp8 pools: the convert partition turns each landed tile into fp16 (and a bf16 q tile is rescaled
    # into fp16); the descales by KV head (and one for all, and none) join the score and output scales
    fp8, descale = FP8_CASES[(d // 64 + page // 16 + causal + PAGED_CASES.index(lens)) % len(FP8_CASES)]
    _check_paged(*lens, page, 4, 2, d, dtype, causal, fp8=fp8, descale=descale)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("q_scale", [1e-33, 1e-6, 3e4, 1e30, 1e33])
def test_gluon_fp8_bf16_queries_of_any_magnitude(gluon, q_scale):
    # bf16 q over fp8 K/V runs its dots in fp16: each Q tile is scaled into fp16's range by a power of
    # two (down for large queries, up for small ones), the scale folded into the score scale; one head's
    # rows span six orders of magnitude too
    lens_q, lens_k = [300, 77], [1300, 129]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    k_cache, v_cache, table = fp8_pool(lens_k, 64, 2, 128)
    q = randn(int(cu_q[-1]), 4, 128, dtype=torch.bfloat16) * q_scale
    q[:, 1] *= torch.logspace(-3, 3, q.shape[0], device=q.device).to(q.dtype)[:, None]
    q = q.to(torch.bfloat16)
    scale = 1.0 / (q_scale * 128 ** 0.5)  # scores of order one
    args = (q, k_cache, v_cache, 2, 300, 1300, table, -1, 0, 0.0)
    assert prefill_hopper.refusal_varlen(*args) is None
    got = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 300, 1300, causal=True, block_table=table,
                                 softmax_scale=scale)
    want = ref.paged_varlen_attention_ref(q, ref.dequantize_ref(k_cache), ref.dequantize_ref(v_cache), cu_q, cu_k,
                                          table, causal=True, softmax_scale=scale)[0]
    assert_close(got, want, torch.bfloat16)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("case", FP8_CASES, ids=str)
def test_gluon_fp8_few_programs_and_packed_kv(gluon, monkeypatch, programs, case):
    # many items a program: the fp8 ring, the converted ring and the convert partition's count of
    # tiles run on across items (and skip the items without rows or keys); packed fp8 K/V too
    monkeypatch.setattr(prefill_hopper, "num_sms", lambda device: programs)
    monkeypatch.setattr(prefill_hopper, "_PLANS", type(prefill_hopper._PLANS)())
    fp8, descale = case
    _check_paged([200, 300, 0, 77, 129], [1000, 700, 50, 400, 129], 32, 4, 1, 128, torch.bfloat16, True,
                 share_first=1, fp8=fp8, descale=descale)
    # packed fp8 K/V: non-causal with a key-less sequence; causal with Sq > Sk (rows that see no key)
    for dtype, causal, lens_k in ((torch.float16, False, [700, 0, 5, 77]), (torch.bfloat16, True, [200, 0, 5, 77])):
        lens_q = [300, 130, 0, 77]
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        q = randn(int(cu_q[-1]), 2, 64, dtype=dtype)
        k, v = (randn(int(cu_k[-1]), 2, 64, dtype=torch.float32).to(fp8) for _ in range(2))
        kd, vd = _descales(descale, 2)
        got, lse = _through_gluon(q, k, v, cu_q, cu_k, 300, max(lens_k), causal=causal, return_lse=True,
                                  k_descale=kd, v_descale=vd)
        want, want_lse = ref.varlen_attention_ref(q, ref.dequantize_ref(k, kd), ref.dequantize_ref(v, vd), cu_q, cu_k,
                                                  causal=causal)
        assert_close(got, want, dtype)
        assert_close(lse, want_lse, torch.float16, name="lse")


@pytest.mark.gpu
@sm90
def test_gluon_paged_in_a_cuda_graph_with_new_pages(gluon):
    # the last page's descriptors are made in the kernel and the others read the table it finds
    dtype, page = torch.bfloat16, 64
    k_cache, v_cache, table = make_pool([1000, 700], page, 2, 128, dtype)
    q = randn(600, 4, 128, dtype=dtype)
    cu_q, cu_k = cu_seqlens([300, 300]), cu_seqlens([1000, 700])
    before = prefill_hopper.launches
    graph, out = capture_graph(lambda: flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 300, 1000,
                                                              causal=True, block_table=table))
    assert prefill_hopper.launches == before + 2  # the warm-up call and the captured one
    for lengths, swap in (([700, 1000], True), ([650, 1000], False)):  # the sequences' pages swapped, then shorter
        if swap:
            table.copy_(table.flip(0))
        cu_k.copy_(cu_seqlens(lengths))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.paged_varlen_attention_ref(q, k_cache, v_cache, cu_q, cu_k, table, causal=True)[0]
        assert_close(out, want, dtype)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_queries_longer_than_keys(gluon, causal):
    q, k, v = randn(2, 200, 4, 64, dtype=torch.bfloat16), randn(2, 130, 2, 64, dtype=torch.bfloat16), \
        randn(2, 130, 2, 64, dtype=torch.bfloat16)
    if causal:  # rows that see no key: the portable kernel's case
        assert "Sq > Sk" in prefill_hopper.refusal(q, k, v, -1, 0, 0.0)
    else:
        _check_gluon(q, k, v, torch.bfloat16, causal=False)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_never_reads_past_a_sequence(gluon, d, causal):
    # K/V rows after each sequence's end (in the same buffer) and the whole next sequence hold NaN and
    # inf: ragged last tiles (Sk = 130 and 1000) must read zeros, not those rows
    dtype = torch.bfloat16
    for sk in (130, 1000):
        buf_k = torch.full((3, sk + 64, 2, d), float("nan"), dtype=dtype, device="cuda")
        buf_v = torch.full((3, sk + 64, 2, d), float("inf"), dtype=dtype, device="cuda")
        buf_k[:2, :sk], buf_v[:2, :sk] = randn(2, sk, 2, d, dtype=dtype), randn(2, sk, 2, d, dtype=dtype)
        k, v = buf_k[:2, :sk], buf_v[:2, :sk]
        q = randn(2, sk, 4, d, dtype=dtype)
        _check_gluon(q, k, v, dtype, causal=causal)
        # sequence 1 of 2, NaN everywhere after it: the last sequence's tail reads past the tensor
        k1, v1 = buf_k[1:2, :sk], buf_v[1:2, :sk]
        buf_k[2:], buf_v[2:] = float("nan"), float("nan")
        _check_gluon(q[1:], k1, v1, dtype, causal=causal)


@pytest.mark.gpu
@sm90
def test_gluon_strided_inputs_and_out(gluon):
    # q/k/v as views of one fused qkv buffer; out a strided view whose padding must stay untouched
    dtype = torch.float16
    qkv = randn(2, 333, 3, 4, 128, dtype=dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    buf = torch.full((2, 333, 4, 136), float("nan"), dtype=dtype, device="cuda")
    out = buf[..., :128]
    got = _check_gluon(q, k, v, dtype, out=out, causal=True)
    assert got is out and buf[..., 128:].isnan().all()
    out_t = torch.empty(2, 4, 333, 128, dtype=dtype, device="cuda").transpose(1, 2)  # [B, Sq, Hq, D] view of BHSD
    assert _check_gluon(q, k, v, dtype, out=out_t, causal=False) is out_t


@pytest.mark.gpu
@sm90
def test_gluon_in_a_cuda_graph(gluon):
    dtype = torch.bfloat16
    q, k, v = randn(2, 700, 8, 128, dtype=dtype), randn(2, 700, 2, 128, dtype=dtype), randn(2, 700, 2, 128, dtype=dtype)
    before = prefill_hopper.launches
    graph, out = capture_graph(lambda: flash_attn_func(q, k, v, causal=True))
    assert prefill_hopper.launches == before + 2  # the warm-up call and the captured one
    for _ in range(2):
        q.copy_(randn(2, 700, 8, 128, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, ref.attention_ref(q, k, v, causal=True)[0], dtype)


@pytest.mark.gpu
@sm90
def test_gluon_under_torch_compile_is_bit_identical(gluon):
    # the routing lives in the operator body: a compiled call takes the Gluon kernel too
    dtype = torch.bfloat16
    q, k, v = randn(2, 500, 8, 64, dtype=dtype), randn(2, 600, 2, 64, dtype=dtype), randn(2, 600, 2, 64, dtype=dtype)

    def fn(q, k, v):
        return flash_attn_func(q, k, v, causal=True, return_lse=True)

    eager = fn(q, k, v)
    before = prefill_hopper.launches
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    assert prefill_hopper.launches > before
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


@pytest.mark.gpu
@sm90
def test_the_measured_cells_take_the_gluon_kernel_on_sm90():
    # the H200 image's Triton is 3.6: the Gluon path must be there, and the bench's cells must take it
    assert prefill_hopper.UNAVAILABLE is None
    if not prefill_hopper.ENABLED:
        pytest.skip("PAGEDFLASH_GLUON=0")
    for d, causal, n in ((128, False, 1024), (128, True, 16384), (64, True, 1024), (64, False, 1024)):
        b, h = 16384 // n, 2048 // d
        q, k, v = (randn(b, n, h, d, dtype=torch.bfloat16) for _ in range(3))
        before = prefill_hopper.launches
        out = flash_attn_func(q, k, v, causal=causal)
        assert prefill_hopper.launches == before + 1, (d, causal, n)
        # the last 128 rows of the last sequence (bottom-right causal: they see what they see in the call)
        want = ref.attention_ref(q[-1:, -128:], k[-1:], v[-1:], causal=causal)[0]
        assert_close(out[-1:, -128:], want, torch.bfloat16)
        del q, k, v, out
    q, k, v = (randn(128, 128, 32, 64, dtype=torch.bfloat16) for _ in range(3))  # under 256: portable
    before = prefill_hopper.launches
    flash_attn_func(q, k, v)
    assert prefill_hopper.launches == before


@pytest.mark.gpu
@sm90
def test_switched_off_takes_the_portable_kernel(gluon, monkeypatch):
    monkeypatch.setattr(prefill_hopper, "ENABLED", False)
    q, k, v = randn(1, 300, 4, 128, dtype=torch.bfloat16), randn(1, 300, 4, 128, dtype=torch.bfloat16), \
        randn(1, 300, 4, 128, dtype=torch.bfloat16)
    before = prefill_hopper.launches
    out = flash_attn_func(q, k, v, causal=True)
    assert prefill_hopper.launches == before
    assert_close(out, ref.attention_ref(q, k, v, causal=True)[0], torch.bfloat16)


def test_a_compiled_call_follows_the_routing_too(monkeypatch):
    # the routing lives in the operator body, which torch.compile's graph calls
    calls = []

    def fake_forward(q, k, v, out, sm_scale, causal, return_lse):
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


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fault", ["lengths", "page id"])
def test_gluon_invalid_metadata_gives_nan_rows_and_a_fault(gluon, paged, fault):
    # value checks off (the default): the host reads nothing; the sequence whose metadata is invalid
    # gets NaN rows and LSE, the others are exact, and raise_if_invalid names the argument
    from pagedflash import validate

    if fault == "page id" and not paged:
        pytest.skip("page ids are paged metadata")
    dtype, d, hq, hkv = torch.bfloat16, 128, 4, 2
    lens_q, lens_k = [300, 200, 130], [700, 900, 130]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(int(cu_q[-1]), hq, d, dtype=dtype)
    if paged:
        k, v, table = make_pool(lens_k, 64, hkv, d, dtype)
    else:
        k, v, table = randn(int(cu_k[-1]), hkv, d, dtype=dtype), randn(int(cu_k[-1]), hkv, d, dtype=dtype), None
    want, want_lse = (ref.paged_varlen_attention_ref(q, k, v, cu_q, cu_k, table, causal=True) if paged
                      else ref.varlen_attention_ref(q, k, v, cu_q, cu_k, causal=True))
    bad_cu_k = cu_k
    if fault == "lengths":  # sequence 1's keys end past the packed keys / the block table's pages
        bad_cu_k = cu_k.clone()
        bad_cu_k[2] = cu_k[1] + (table.shape[1] * 64 + 1 if paged else int(cu_k[-1]))
    else:  # a page id outside the pool in sequence 1's pages
        table = table.clone()
        table[1, 3] = k.shape[0] + 5
    validate.invalid_metadata()
    with validate.value_checks(False):
        got, lse = _through_gluon(q, k, v, cu_q, bad_cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True,
                                  block_table=table)
    rows = slice(int(cu_q[1]), int(cu_q[2]))
    assert got[rows].isnan().all() and lse[:, rows].isnan().all()
    others = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    others[rows] = False
    if fault == "lengths":  # the next sequence starts at sequence 1's bad end: invalid too
        others[int(cu_q[2]):] = False
    assert_close(got[others], want[others], dtype)
    assert_close(lse[:, others], want_lse[:, others], torch.float16, name="lse")
    name = "block_table" if fault == "page id" else "cu_seqlens_k"
    with pytest.raises(ValueError, match=name):
        validate.raise_if_invalid()


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("paged", [False, True])
def test_gluon_relaunches_through_its_fast_handle(gluon, paged):
    # a signature's second call goes through the plan's fast handle (pagedflash.ops.fastlaunch), with
    # the same results, and the fast path stays on (a failed handle would turn it off for the process)
    from pagedflash.ops import fastlaunch

    if not fastlaunch.enabled() or fastlaunch._detect() is not None:
        pytest.skip(f"fast launch: {fastlaunch.status()}")
    for _ in range(3):
        if paged:
            _check_paged([300, 100], [700, 900], 64, 4, 2, 128, torch.bfloat16, True)
        else:
            _check_varlen([300, 200], [300, 200], 4, 2, 128, torch.bfloat16, True)
    assert fastlaunch.enabled(), fastlaunch.status()
    assert any(plan.slot.handle is not None for plan in prefill_hopper._PLANS.values())

"""Attention's per-signature launch plans (a cached plan equals a fresh one; every input of
Triton's specialization is in the key; the cache is bounded) and the reused split-KV partials,
with the kernels replaced by recorders: host logic only."""

import threading
import types

import pytest
import torch
from helpers import DEVICE, assert_close, cu_seqlens, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from pagedflash import reference as ref
from pagedflash.ops import attention, attention_plan, combine, launch, scratch

# ---------------------------------------------------------------- launch plans


def _shapes():
    """A spread of signatures: dense, varlen, paged, decode with splits, GQA, windows, lse."""
    yield "prefill", dict(q=randn(2, 37, 4, 24), k=randn(2, 50, 2, 24), causal=True)
    yield "prefill_window", dict(q=randn(1, 200, 2, 32), k=randn(1, 200, 2, 32), window=(16, 0))
    yield "prefill_fp16_softcap", dict(q=randn(1, 64, 8, 64, dtype=torch.float16),
                                       k=randn(1, 64, 1, 64, dtype=torch.float16), softcap=10.0)
    yield "decode", dict(q=randn(3, 1, 8, 40), k=randn(3, 300, 2, 40), seqlens=[300, 3, 0])
    yield "decode_spec", dict(q=randn(2, 4, 8, 64), k=randn(2, 90, 8, 64), seqlens=[90, 17], splits=3)
    yield "paged", dict(q=randn(2, 1, 4, 32), page=16, seqlens=[100, 31])
    yield "varlen", dict(lq=[5, 1, 17], lk=[9, 40, 17])
    yield "paged_fp8_sinks", dict(q=randn(2, 1, 4, 32), page=16, seqlens=[100, 31], fp8=True)


def _call(spec):
    """The public call of a ``_shapes`` spec (fresh inputs of the same signature each time)."""
    spec = dict(spec)
    if "lq" in spec:
        lq, lk = spec["lq"], spec["lk"]
        return flash_attn_varlen_func(randn(sum(lq), 4, 32), randn(sum(lk), 2, 32), randn(sum(lk), 2, 32),
                                      cu_seqlens(lq), cu_seqlens(lk), max(lq), max(lk), causal=True)
    q = spec["q"]
    if "page" in spec:
        k, v, table = make_pool(spec["seqlens"], spec["page"], 2, q.shape[-1], q.dtype)
        lens = torch.tensor(spec["seqlens"], dtype=torch.int32, device=DEVICE)
        side = {}
        if spec.get("fp8"):  # fp8 pages, per-KV-head key descales, a per-tensor value descale, sinks
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            side = dict(k_descale=torch.tensor([0.5, 2.0], device=DEVICE), v_descale=torch.tensor(0.7, device=DEVICE),
                        sinks=randn(q.shape[2]))
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, **side)
    k = spec["k"]
    if "seqlens" in spec:
        lens = torch.tensor(spec["seqlens"], dtype=torch.int32, device=DEVICE)
        return flash_attn_with_kvcache(q, k, k.clone(), cache_seqlens=lens, num_splits=spec.get("splits", 0),
                                       return_lse=True)
    return flash_attn_func(q, k, k.clone(), causal=spec.get("causal", False), window_size=spec.get("window", (-1, -1)),
                           softcap=spec.get("softcap", 0.0))


class _Recorder:
    """A kernel whose launch records its grid, scalar arguments and constexprs, and runs nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            scalars = tuple(a for a in args if not isinstance(a, torch.Tensor))
            self.launches.append((grid, scalars, kwargs))
        return launch


@pytest.fixture
def no_kernels(monkeypatch):
    """attention's and combine's kernels replaced by ``_Recorder`` (plans only: nothing computed)."""
    kernels = types.SimpleNamespace(attention=_Recorder(), combine=_Recorder())
    monkeypatch.setattr(attention, "_attention_kernel", kernels.attention)
    monkeypatch.setattr(combine, "_combine_kernel", kernels.combine)
    attention.clear_plans()
    yield kernels
    attention.clear_plans()


_PLAN_FIELDS = ("cfg", "tma_on", "num_splits", "grid", "part_shapes", "ints", "head_strides", "window", "consts",
                "fallback_key", "tokens_per_batch")


@pytest.mark.parametrize("name,spec", list(_shapes()), ids=[n for n, _ in _shapes()])
def test_cached_plan_equals_a_fresh_one(no_kernels, name, spec):
    """The second call of a signature reuses its plan, and launches exactly what a fresh plan
    launches: the same grid, tiles, split count and scalar arguments (combine's too)."""
    _call(spec)
    assert len(attention._PLANS) == 1
    (key, plan), = attention._PLANS.items()
    _call(spec)
    assert len(attention._PLANS) == 1 and attention._PLANS[key] is plan  # reused
    attention.clear_plans()
    _call(spec)
    fresh = attention._PLANS[key]
    assert fresh is not plan
    for field in _PLAN_FIELDS:
        assert getattr(fresh, field) == getattr(plan, field), field
    first, again, recomputed = no_kernels.attention.launches
    assert first == again == recomputed
    if plan.num_splits > 1:
        first, again, recomputed = no_kernels.combine.launches
        assert first == again == recomputed


def _decode_key_variants():
    """A decode call and calls that differ from it in one thing Triton specializes on."""
    def call(q, k, lens=None, **kw):
        lens = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE) if lens is None else lens
        return flash_attn_with_kvcache(q, k, k.clone() if k.is_contiguous() else k, cache_seqlens=lens, **kw)

    q, k = randn(2, 1, 4, 32), randn(2, 24, 2, 32)
    wide = randn(2, 24, 4, 32)
    offset = randn(2 * 4 * 32 + 4).narrow(0, 4, 2 * 4 * 32).view(2, 1, 4, 32)  # 16 bytes off: still aligned
    skewed = randn(2 * 4 * 32 + 1).narrow(0, 1, 2 * 4 * 32).view(2, 1, 4, 32)  # 4 bytes off: misaligned
    yield "base", lambda: call(q, k)
    yield "dtype", lambda: call(q.half(), k.half())
    yield "shape", lambda: call(randn(2, 1, 4, 32), randn(2, 25, 2, 32))
    yield "stride", lambda: call(q, wide[:, :, 1:3])  # a strided view of a larger cache
    yield "misaligned", lambda: call(skewed, k)
    yield "lse", lambda: call(q, k, return_lse=True)
    yield "splits", lambda: call(q, k, num_splits=2)
    yield "window", lambda: call(q, k, window_size=(5, -1))
    yield "softcap", lambda: call(q, k, softcap=3.0)
    yield "same_as_base_aligned_offset", lambda: call(offset, k)
    # the side inputs: given or not, their head stride (one value for all heads, or one per head)
    k8, one, per_head = k.to(torch.float8_e4m3fn), torch.tensor([0.5], device=DEVICE), torch.tensor([0.5, 2.0],
                                                                                                   device=DEVICE)
    yield "sinks", lambda: call(q, k, sinks=randn(4))
    yield "same_as_sinks_other_values", lambda: call(q, k, sinks=randn(4))
    yield "sinks_strided", lambda: call(q, k, sinks=randn(8)[::2])
    yield "fp8", lambda: call(q, k8)
    yield "fp8_k_descale_per_tensor", lambda: call(q, k8, k_descale=one)
    yield "same_as_fp8_k_descale_per_tensor_0d", lambda: call(q, k8, k_descale=torch.tensor(3.0, device=DEVICE))
    yield "fp8_k_descale_per_head", lambda: call(q, k8, k_descale=per_head)
    yield "fp8_v_descale_per_head", lambda: call(q, k8, v_descale=per_head)


def test_a_changed_signature_misses_the_plan_cache(no_kernels, monkeypatch):
    keys = {}
    for name, call in _decode_key_variants():
        before = set(attention._PLANS)
        call()
        new = set(attention._PLANS) - before
        keys[name] = new
    assert all(len(new) == 1 for name, new in keys.items() if not name.startswith("same_as_")), keys
    assert len(keys["same_as_fp8_k_descale_per_tensor_0d"]) <= 1
    assert not keys["same_as_base_aligned_offset"]  # only the pointer moved, its alignment class did not
    assert not keys["same_as_sinks_other_values"]
    # a 0-d descale where a [1] one was: the same launch; the public key (its checks read the shape)
    # may keep it under a key of its own, with the same plan
    for extra in keys["same_as_fp8_k_descale_per_tensor_0d"]:
        same = attention._PLANS[next(iter(keys["fp8_k_descale_per_tensor"]))]
        assert all(getattr(same, f) == getattr(attention._PLANS[extra], f) for f in _PLAN_FIELDS)
    for switch in ("TMA", "TMA_FP8"):  # the launch table's switches are part of the key
        monkeypatch.setattr(launch, switch, not getattr(launch, switch))
        before = set(attention._PLANS)
        dict(_decode_key_variants())["base"]()
        assert len(set(attention._PLANS) - before) == 1


def test_a_public_plan_key_determines_plan_key(no_kernels, monkeypatch):
    """A public call's plan key (:func:`attention_plan.public_plan_key`, from its checks' key) stands
    for one :func:`attention_plan.plan_key`: every call under it would have made the same plan."""
    from pagedflash.ops import decode, prefill
    real, seen = attention.attention_forward, {}

    def spy(q, k, v, *, signature=None, **kw):
        if signature is not None:
            lse = None
            if kw.get("return_lse"):
                lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
            key = attention_plan.plan_key(
                q, k, v, kw["out"], lse, q.device, kw["batch"], kw["max_seqlen_q"], kw["max_seqlen_k"],
                tuple(kw["window"]), float(kw["softcap"]), None, None, kw.get("seqused_k"), kw.get("block_table"),
                kw.get("num_splits", 0), None, kw.get("sinks"), kw.get("k_descale"), kw.get("v_descale"),
                kw.get("batch_invariant", False))
            seen.setdefault(signature, set()).add(key)
        return real(q, k, v, signature=signature, **kw)

    for module in (decode, prefill):
        monkeypatch.setattr(module, "attention_forward", spy)
    for _, call in _decode_key_variants():
        call()
        call()
    for _, spec in _shapes():
        if "lq" not in spec:
            _call(spec)
            _call(spec)
    q, k = randn(1, 20, 4, 32), randn(1, 20, 2, 32)
    for kw in (dict(causal=True), dict(return_lse=True), dict(batch_invariant=True), dict(window_size=(3, 0))):
        flash_attn_func(q, k, k, **kw)
    assert len(seen) > 20
    assert all(len(keys) == 1 for keys in seen.values())


@pytest.mark.parametrize("page", [0, 16, 64])
def test_fp8_v_converts_before_the_dot_on_fp8_caches(no_kernels, monkeypatch, page):
    """``FP8_CVT`` (the pinned fp8 -> fp16 conversion of V tiles): on for fp8 caches, contiguous or
    paged, exactly where :func:`fp8_cvt_device` allows it (never on the CPU)."""
    assert not attention_plan.fp8_cvt_device(torch.device("cpu"))
    monkeypatch.setattr(attention_plan, "fp8_cvt_device", lambda device: True)
    q = randn(2, 1, 4, 32)
    lens = torch.tensor([100, 31], dtype=torch.int32, device=DEVICE)
    for dtype in (torch.float8_e4m3fn, q.dtype):
        if page:
            k, v, table = make_pool([100, 31], page, 2, 32, q.dtype)
        else:
            k, v, table = randn(2, 128, 2, 32), randn(2, 128, 2, 32), None
        flash_attn_with_kvcache(q, k.to(dtype), v.to(dtype), cache_seqlens=lens, block_table=table)
        assert no_kernels.attention.launches[-1][2]["FP8_CVT"] is (dtype != q.dtype)


def test_plan_cache_is_bounded(no_kernels, monkeypatch):
    monkeypatch.setattr(attention._PLANS, "maxsize", 2)
    for n in (16, 17, 18):
        flash_attn_func(randn(1, n, 2, 16), randn(1, n, 2, 16), randn(1, n, 2, 16))
    assert len(attention._PLANS) == 1  # started over at the third signature


def test_a_bad_config_is_refused_on_every_call():
    from pagedflash.ops.launch import LaunchConfig

    q, k = randn(1, 1, 4, 32), randn(1, 16, 2, 32)
    for _ in range(2):  # nothing cached the first time lets the second through
        with pytest.raises(ValueError, match="config.g_pack"):
            attention.attention_forward(q, k, k, batch=1, max_seqlen_q=1, max_seqlen_k=16, sm_scale=0.1,
                                        window=(-1, 0), softcap=0.0, config=LaunchConfig(16, 16, g_pack=3))


def test_out_is_written_in_place():
    q, k = randn(1, 9, 4, 32), randn(1, 9, 2, 32)
    big = randn(1, 9, 8, 32)
    out = big[:, :, 2:6]  # a strided output
    got, _ = attention.attention_forward(q, k, k, batch=1, max_seqlen_q=9, max_seqlen_k=9, sm_scale=32 ** -0.5,
                                         window=(-1, 0), softcap=0.0, out=out)
    assert got is out
    assert_close(big[:, :, 2:6], ref.attention_ref(q, k, k, causal=True)[0], torch.float32)


# ---------------------------------------------------------------- reused buffers


def test_buffers_are_fresh_on_the_cpu_by_default():
    a, = scratch.buffers((((4,), torch.float32),), torch.device("cpu"))
    b, = scratch.buffers((((4,), torch.float32),), torch.device("cpu"))
    assert a is not b  # the tests' NaN poisoning of fresh memory stays in force


def test_buffers_are_reused_per_thread_and_bounded(monkeypatch):
    monkeypatch.setattr(scratch, "CPU", True)
    scratch.clear()
    cpu = torch.device("cpu")
    spec = (((3, 4), torch.float32), ((3,), torch.float32))
    first = scratch.buffers(spec, cpu)
    assert all(a is b for a, b in zip(first, scratch.buffers(spec, cpu)))
    other = []
    thread = threading.Thread(target=lambda: other.extend(scratch.buffers(spec, cpu)))
    thread.start()
    thread.join()
    assert not any(a is b for a, b in zip(first, other))  # another thread never shares them
    for n in range(scratch.MAX_BUFFERS):
        scratch.buffers((((n + 10,), torch.float32),), cpu)
    assert scratch.buffers(spec, cpu)[0] is not first[0]  # the oldest was dropped
    scratch.clear()

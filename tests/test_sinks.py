"""Attention sinks (gpt-oss): one logit per query head in the softmax denominator, on every path.

``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink_h))``, LSE ``log(sum_k exp(s_k) + exp(sink_h))``; a row
that sees no key gets output 0 and LSE = sink. The sink must count exactly once: under split-KV
(empty splits included), in GQA-packed tiles (rows of one tile are different query heads), with
windows and softcaps (which apply to the scores, not to the sink). Under the interpreter each path
runs one or two covering cases (the CI's time is short); compiled on a GPU the full products run.
"""

import pytest
import torch
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, cu_seqlens, fp8_pool, ids, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, validate
from pagedflash import flash_attn_interface as fa
from pagedflash import reference as ref

LSE_TOL = {torch.float32: torch.float32, torch.float16: torch.float16, torch.bfloat16: torch.float16}
CAUSAL, NONCAUSAL, LOCAL = dict(causal=True), dict(causal=False), dict(window_size=(7, 3), softcap=3.0)
# (dtype, Hq, Hkv, Sq, Sk, options): the full product on the GPU, a covering subset under the interpreter
DENSE = ([(dt, hq, hkv, sq, sk, o) for dt in DTYPES for hq, hkv in ((4, 4), (8, 2), (5, 1))
          for sq, sk in ((37, 45), (45, 21), (1, 30)) for o in (NONCAUSAL, CAUSAL, LOCAL)] if ON_GPU else
         [(torch.float32, 8, 2, 45, 21, CAUSAL), (torch.float16, 5, 1, 1, 30, LOCAL)])


def sinks_for(hq: int) -> torch.Tensor:
    """Logits of the scores' order of magnitude (a sink far below them would change nothing)."""
    return randn(hq) * 2 + 1


@pytest.mark.parametrize("dtype,hq,hkv,sq,sk,opts", DENSE, ids=ids)
def test_dense(dtype, hq, hkv, sq, sk, opts):
    q = randn(2, sq, hq, 32, dtype=dtype)
    k, v = randn(2, sk, hkv, 32, dtype=dtype), randn(2, sk, hkv, 32, dtype=dtype)
    sinks = sinks_for(hq)
    out, lse = flash_attn_func(q, k, v, return_lse=True, sinks=sinks, **opts)
    ref_out, ref_lse = ref.attention_ref(q, k, v, sinks=sinks, **opts)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, LSE_TOL[dtype], name="lse")


def test_rows_that_see_no_key_give_zero_and_the_sink():
    q, k, v = randn(1, 9, 4, 32), randn(1, 4, 2, 32), randn(1, 4, 2, 32)
    sinks = sinks_for(4)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, sinks=sinks)  # rows 0..4 see nothing
    assert torch.equal(out[0, :5], torch.zeros_like(out[0, :5]))
    assert_close(lse[0, :, :5], sinks[:, None].expand(4, 5), torch.float32, name="lse")  # via log2 and back
    lens = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    for splits in (1, 4):
        out, lse = flash_attn_with_kvcache(q[:, :1].expand(2, 1, 4, 32), k.expand(2, 4, 2, 32), v.expand(2, 4, 2, 32),
                                           cache_seqlens=lens, num_splits=splits, return_lse=True, sinks=sinks)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert_close(lse[0, :, 0], sinks, torch.float32, name="lse")
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_sink_limits():
    """A sink of -inf is no sink; a sink far above the scores leaves almost nothing of V."""
    q, k, v = randn(2, 5, 4, 32), randn(2, 20, 2, 32), randn(2, 20, 2, 32)
    plain = flash_attn_func(q, k, v, causal=True)
    none = flash_attn_func(q, k, v, causal=True, sinks=torch.full((4,), float("-inf"), device=DEVICE))
    assert_close(none, plain, torch.float32)
    big = flash_attn_func(q, k, v, causal=True, sinks=torch.full((4,), 60.0, device=DEVICE))
    assert big.abs().max() < 1e-12


@pytest.mark.parametrize("dtype,num_splits", [(dt, n) for dt in DTYPES for n in (1, 3, 0)] if ON_GPU else
                         [(torch.float16, 3)], ids=ids)
def test_varlen(dtype, num_splits):
    lens_q, lens_k = [5, 0, 31, 1], [9, 4, 31, 40]
    q = randn(sum(lens_q), 8, 32, dtype=dtype)
    k, v = randn(sum(lens_k), 2, 32, dtype=dtype), randn(sum(lens_k), 2, 32, dtype=dtype)
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    sinks = sinks_for(8)
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=True, num_splits=num_splits,
                                      return_lse=True, sinks=sinks)
    ref_out, ref_lse = ref.varlen_attention_ref(q, k, v, cq, ck, causal=True, sinks=sinks)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, LSE_TOL[dtype], name="lse")


# (Hq, Hkv, Sq, num_splits); 8 splits leave the short rows' splits empty, 40 those of every row
DECODE = ([(hq, hkv, sq, n) for hq, hkv, sq in ((8, 2, 1), (5, 1, 4), (4, 4, 1)) for n in (1, 3, 8, 40, 0)]
          if ON_GPU else [(8, 2, 1, 8), (5, 1, 4, 3)])


@pytest.mark.parametrize("dtype", DTYPES if ON_GPU else DTYPES[-1:], ids=ids)
@pytest.mark.parametrize("hq,hkv,sq,num_splits", DECODE, ids=str)
def test_decode_split_kv(dtype, hq, hkv, sq, num_splits):
    q = randn(3, sq, hq, 64, dtype=dtype)
    k_cache, v_cache = randn(3, 70, hkv, 64, dtype=dtype), randn(3, 70, hkv, 64, dtype=dtype)
    lens = torch.tensor([70, 33, 5], dtype=torch.int32, device=DEVICE)
    sinks = sinks_for(hq)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=num_splits,
                                       return_lse=True, sinks=sinks)
    ref_out, ref_lse = ref.kvcache_attention_ref(q, k_cache, v_cache, lens, sinks=sinks)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, LSE_TOL[dtype], name="lse")


PAGED = ([(page, n, o) for page in (1, 5, 16, 64)
          for n, o in ((0, CAUSAL), (1, CAUSAL), (3, dict(causal=True, window_size=(20, 0), softcap=4.0)))]
         if ON_GPU else [(5, 3, dict(causal=True, window_size=(20, 0), softcap=4.0))])


@pytest.mark.parametrize("page,num_splits,opts", PAGED, ids=str)
def test_paged_mixed_batch(page, num_splits, opts):
    dtype = DTYPES[-1]
    new, cached = [20, 1, 1, 9, 3], [0, 40, 5, 20, 60]
    total = [c + n for c, n in zip(cached, new)]
    k_cache, v_cache, table = make_pool(total, page, 2, 48, dtype)
    q = randn(sum(new), 6, 48, dtype=dtype)
    cq, ck = cu_seqlens(new), cu_seqlens(total)
    sinks = sinks_for(6)
    out, lse = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(new), max(total), block_table=table,
                                      num_splits=num_splits, return_lse=True, sinks=sinks, **opts)
    ref_out, ref_lse = ref.paged_varlen_attention_ref(q, k_cache, v_cache, cq, ck, table, sinks=sinks, **opts)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, LSE_TOL[dtype], name="lse")


@pytest.mark.parametrize("page", [1, 16] if ON_GPU else [16])
def test_paged_decode_with_appends(page):
    lens = torch.tensor([0, 17, 40], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache, table = make_pool([n + 2 for n in lens.tolist()], page, 2, 32, torch.float32)
    q, k_new, v_new = randn(3, 2, 4, 32), randn(3, 2, 2, 32), randn(3, 2, 2, 32)
    sinks = sinks_for(4)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens, block_table=table,
                                  num_splits=2, sinks=sinks)
    ref.append_ref(k_ref, v_ref, k_new, v_new, lens, block_table=table)
    want = ref.kvcache_attention_ref(q, k_ref, v_ref, lens + 2, block_table=table, sinks=sinks)[0]
    assert_close(out, want, torch.float32)


def test_fp8_cache_with_sinks():
    kd, vd = torch.tensor([0.5, 2.0], device=DEVICE), torch.tensor(0.7, device=DEVICE)
    k_cache, v_cache, table = fp8_pool([50, 9], 16, 2, 32)
    q, lens, sinks = randn(2, 1, 8, 32), torch.tensor([50, 9], dtype=torch.int32, device=DEVICE), sinks_for(8)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, num_splits=3,
                                  k_descale=kd, v_descale=vd, sinks=sinks)
    want = ref.kvcache_attention_ref(q, ref.dequantize_ref(k_cache, kd), ref.dequantize_ref(v_cache, vd), lens,
                                     block_table=table, sinks=sinks)[0]
    assert_close(out, want, torch.float32)


def test_flash_attn_interface_learnable_sink():
    """flash-attn 4's name for it, on flash-attn 2's signatures (positional arguments unchanged)."""
    q, k, v = randn(2, 6, 4, 32), randn(2, 9, 2, 32), randn(2, 9, 2, 32)
    sinks = sinks_for(4)
    want = ref.attention_ref(q, k, v, causal=True, sinks=sinks)
    out, lse, _ = fa.flash_attn_func(q, k, v, 0.0, None, True, return_attn_probs=True, learnable_sink=sinks)
    assert_close(out, want[0], torch.float32)
    assert_close(lse, want[1], torch.float32, name="lse")
    qkv = torch.stack([q, k[:, :6].repeat_interleave(2, 2), v[:, :6].repeat_interleave(2, 2)], dim=2)
    packed = fa.flash_attn_qkvpacked_func(qkv, causal=True, learnable_sink=sinks)
    assert_close(packed, ref.attention_ref(*qkv.unbind(2), causal=True, sinks=sinks)[0], torch.float32)
    cu = cu_seqlens([6, 6])
    out = fa.flash_attn_varlen_func(q.flatten(0, 1), k[:, :6].flatten(0, 1), v[:, :6].flatten(0, 1), cu, cu, 6, 6,
                                    causal=True, learnable_sink=sinks)
    assert_close(out, ref.attention_ref(q, k[:, :6], v[:, :6], causal=True, sinks=sinks)[0].flatten(0, 1),
                 torch.float32)
    lens = torch.tensor([9, 4], dtype=torch.int32, device=DEVICE)
    out = fa.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=lens, causal=True, learnable_sink=sinks)
    assert_close(out, ref.kvcache_attention_ref(q[:, :1], k, v, lens, sinks=sinks)[0], torch.float32)


@pytest.mark.parametrize(
    "sinks,exc,match",
    [
        (torch.zeros(3), ValueError, r"sinks: expected shape \[4\] \(one logit per query head, Hq\), got \[3\]"),
        (torch.zeros(1, 4), ValueError, "sinks: expected a 1-D tensor"),
        (torch.zeros(4, dtype=torch.float16), TypeError, "sinks: expected dtype"),
        (torch.tensor([0.0, float("nan"), 0.0, 0.0]), ValueError, "sinks: expected finite logits"),
        (torch.tensor([0.0, float("inf"), 0.0, 0.0]), ValueError, "sinks: expected finite logits"),
        ([0.0] * 4, TypeError, "sinks: expected a torch.Tensor"),
    ],
)
def test_bad_sinks_rejected(sinks, exc, match):
    if isinstance(sinks, torch.Tensor):
        sinks = sinks.to(DEVICE)
    q, k, v = randn(1, 4, 4, 32), randn(1, 4, 2, 32), randn(1, 4, 2, 32)
    cu = cu_seqlens([4])
    for call in (lambda: flash_attn_func(q, k, v, sinks=sinks),
                 lambda: flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, sinks=sinks),
                 lambda: flash_attn_with_kvcache(q, k, v, sinks=sinks)):
        with validate.value_checks(True), pytest.raises(exc, match=match):  # NaN / inf: the debug mode's
            call()


def test_sinks_that_require_grad_are_refused_unless_autograd_is_off():
    q, k, v = randn(1, 4, 4, 32), randn(1, 4, 2, 32), randn(1, 4, 2, 32)
    sinks = sinks_for(4).requires_grad_(True)
    with pytest.raises(ValueError, match="sinks: requires grad"):
        flash_attn_func(q, k, v, sinks=sinks)
    with torch.no_grad():
        flash_attn_func(q, k, v, sinks=sinks)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the compiled bf16 matrix runs on the GPU")
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_every_path_bf16(tma, monkeypatch):
    """bf16 at serving sizes, through TMA descriptors (dense prefill, 64-row pages) and pointers."""
    from pagedflash.ops import launch

    monkeypatch.setattr(launch, "TMA", tma)
    launch.choose_config.cache_clear()
    dtype, hq, hkv, d = torch.bfloat16, 32, 8, 128
    sinks = sinks_for(hq)
    q, k, v = randn(2, 777, hq, d, dtype=dtype), randn(2, 1029, hkv, d, dtype=dtype), randn(2, 1029, hkv, d, dtype=dtype)
    for opts in (dict(causal=True), dict(window_size=(128, 0), softcap=30.0)):
        assert_close(flash_attn_func(q, k, v, sinks=sinks, **opts), ref.attention_ref(q, k, v, sinks=sinks, **opts)[0],
                     dtype)
    for page in (16, 64, 256):
        new, cached = [512, 1, 1, 77], [4096, 9000, 0, 300]
        total = [c + n for c, n in zip(cached, new)]
        k_cache, v_cache, table = make_pool(total, page, hkv, d, dtype, spare=2)
        qp = randn(sum(new), hq, d, dtype=dtype)
        cq, ck = cu_seqlens(new), cu_seqlens(total)
        out = flash_attn_varlen_func(qp, k_cache, v_cache, cq, ck, max(new), max(total), causal=True,
                                     block_table=table, sinks=sinks)
        want = ref.paged_varlen_attention_ref(qp, k_cache, v_cache, cq, ck, table, causal=True, sinks=sinks)[0]
        assert_close(out, want, dtype)
        lens = torch.tensor(total, dtype=torch.int32, device=DEVICE)
        qd = randn(len(total), 1, hq, d, dtype=dtype)
        out = flash_attn_with_kvcache(qd, k_cache, v_cache, cache_seqlens=lens, block_table=table, sinks=sinks)
        assert_close(out, ref.kvcache_attention_ref(qd, k_cache, v_cache, lens, block_table=table, sinks=sinks)[0],
                     dtype)
    launch.choose_config.cache_clear()

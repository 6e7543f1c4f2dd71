"""The Gluon Hopper prefill kernel's paged path on an sm90 GPU (``@pytest.mark.gpu``; skipped
elsewhere), over NaN-poisoned pools with pages in random order, against the fp32 reference: chunks
over a cached prefix at page sizes 16 to 384, few programs over a shared prefix, strided caches and
block table, a CUDA graph replayed with new pages; fp8 K/V (e4m3/e5m2; descales per tensor, per KV
head, or none) against the reference over the dequantized values, paged and packed, with bf16
queries of any magnitude.
"""

import prefill_hopper_checks as checks
import pytest
import torch
from helpers import assert_close, cu_seqlens, fp8_pool, ids, make_pool, randn
from prefill_hopper_checks import check_paged, descales, sm90, through_gluon

from pagedflash import flash_attn_varlen_func
from pagedflash import reference as ref
from pagedflash.ops import prefill_hopper
from pagedflash.testing import capture_graph

gluon = checks.gluon  # the shared fixture, found by its name here


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
    check_paged(*lens, page, 4, 2, d, dtype, causal)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("page", [32, 128])
def test_gluon_paged_few_programs_and_a_shared_prefix(gluon, monkeypatch, programs, page):
    # many items a program, each rewriting its last page's descriptors; every sequence's first pages
    # are the first sequence's (prefix caching)
    monkeypatch.setattr(prefill_hopper, "num_sms", lambda device: programs)
    monkeypatch.setattr(prefill_hopper, "_PLANS", type(prefill_hopper._PLANS)())
    check_paged([200, 300, 77, 129], [1000, 700, 400, 129], page, 4, 1, 128, torch.bfloat16, True, share_first=1)
    check_paged([200, 300, 77, 129], [1000, 700, 400, 129], page, 2, 2, 64, torch.bfloat16, False)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("page", [16, 128, 384])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_paged_strided_caches_and_table_without_lse(gluon, page, causal):
    # wider rows than Hkv * D in the caches (the host and the device descriptors take the token
    # stride), a block table narrower than its rows, no LSE; a page of 384 rows (3 key tiles a page)
    check_paged([300, 100, 1], [1300, 320, 129], page, 4, 2, 128, torch.bfloat16, causal, return_lse=False,
                odd=True)


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
    check_paged(*lens, page, 4, 2, d, dtype, causal, fp8=fp8, descale=descale)


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
    check_paged([200, 300, 0, 77, 129], [1000, 700, 50, 400, 129], 32, 4, 1, 128, torch.bfloat16, True,
                share_first=1, fp8=fp8, descale=descale)
    # packed fp8 K/V: non-causal with a key-less sequence; causal with Sq > Sk (rows that see no key)
    for dtype, causal, lens_k in ((torch.float16, False, [700, 0, 5, 77]), (torch.bfloat16, True, [200, 0, 5, 77])):
        lens_q = [300, 130, 0, 77]
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        q = randn(int(cu_q[-1]), 2, 64, dtype=dtype)
        k, v = (randn(int(cu_k[-1]), 2, 64, dtype=torch.float32).to(fp8) for _ in range(2))
        kd, vd = descales(descale, 2)
        got, lse = through_gluon(q, k, v, cu_q, cu_k, 300, max(lens_k), causal=causal, return_lse=True,
                                 k_descale=kd, v_descale=vd)
        want, want_lse = ref.varlen_attention_ref(q, ref.dequantize_ref(k, kd), ref.dequantize_ref(v, vd), cu_q, cu_k,
                                                  causal=causal)
        assert_close(got, want, dtype)
        assert_close(lse, want_lse, torch.float16, name="lse")

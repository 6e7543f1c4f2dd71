"""The Gluon Hopper prefill kernel's dense path on an sm90 GPU (``@pytest.mark.gpu``; skipped
elsewhere), against the fp32 reference: fp16/bf16, D 64/128, causal or not, GQA, Sq < Sk, odd
lengths, ragged last tiles in several sequences, few persistent programs taking many items, NaN past
each sequence, strided inputs, ``out=``, LSE, a CUDA graph, torch.compile; the bench's measured cells
take the kernel, and switched off the portable kernel runs. The launch counter proves the Gluon
kernel ran; the shapes are small, so the measured-size rule is lifted for them (``gluon``).
"""

import prefill_hopper_checks as checks
import pytest
import torch
from helpers import assert_close, ids, randn
from prefill_hopper_checks import check_gluon, sm90

from pagedflash import flash_attn_func
from pagedflash import reference as ref
from pagedflash.ops import prefill_hopper
from pagedflash.testing import capture_graph

gluon = checks.gluon  # the shared fixture, found by its name here


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
    check_gluon(q, k, v, dtype, causal=causal)


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
        check_gluon(q, k, v, dtype, causal=causal)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_queries_longer_than_keys(gluon, causal):
    q, k, v = randn(2, 200, 4, 64, dtype=torch.bfloat16), randn(2, 130, 2, 64, dtype=torch.bfloat16), \
        randn(2, 130, 2, 64, dtype=torch.bfloat16)
    if causal:  # rows that see no key: the portable kernel's case
        assert "Sq > Sk" in prefill_hopper.refusal(q, k, v, -1, 0, 0.0)
    else:
        check_gluon(q, k, v, torch.bfloat16, causal=False)


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
        check_gluon(q, k, v, dtype, causal=causal)
        # sequence 1 of 2, NaN everywhere after it: the last sequence's tail reads past the tensor
        k1, v1 = buf_k[1:2, :sk], buf_v[1:2, :sk]
        buf_k[2:], buf_v[2:] = float("nan"), float("nan")
        check_gluon(q[1:], k1, v1, dtype, causal=causal)


@pytest.mark.gpu
@sm90
def test_gluon_strided_inputs_and_out(gluon):
    # q/k/v as views of one fused qkv buffer; out a strided view whose padding must stay untouched
    dtype = torch.float16
    qkv = randn(2, 333, 3, 4, 128, dtype=dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    buf = torch.full((2, 333, 4, 136), float("nan"), dtype=dtype, device="cuda")
    out = buf[..., :128]
    got = check_gluon(q, k, v, dtype, out=out, causal=True)
    assert got is out and buf[..., 128:].isnan().all()
    out_t = torch.empty(2, 4, 333, 128, dtype=dtype, device="cuda").transpose(1, 2)  # [B, Sq, Hq, D] view of BHSD
    assert check_gluon(q, k, v, dtype, out=out_t, causal=False) is out_t


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

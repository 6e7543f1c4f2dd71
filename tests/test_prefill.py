"""Fused prefill (dense and varlen) against the fp32 reference."""

import pytest
import torch
from helpers import DTYPES, ON_GPU, assert_close, cu_seqlens, ids, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func
from pagedflash import reference as ref

HEAD_DIMS = [16, 40, 64, 72, 80, 96, 112, 128, 200, 256] if ON_GPU else [16, 40, 72, 128, 200]
# (Sq, Sk): equal, q shorter, q longer (rows that see nothing under causal), ones, odd sizes
LENGTHS = [(1, 1), (17, 17), (33, 64), (64, 33), (1, 40), (40, 1), (65, 130)]
if ON_GPU:
    LENGTHS += [(113, 203), (128, 128), (255, 257), (1023, 1025), (2048, 2048)]
HEADS = [(2, 2), (4, 1), (5, 1), (6, 2), (8, 8)] if ON_GPU else [(2, 2), (4, 1), (6, 2)]


def _check(q, k, v, dtype, **opts):
    out, lse = flash_attn_func(q, k, v, return_lse=True, **opts)
    ref_out, ref_lse = ref.attention_ref(q, k, v, **opts)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(dtype, head_dim, causal):
    q, k, v = (randn(2, 37, 4, head_dim, dtype=dtype) for _ in range(3))
    _check(q, k[:, :, :2].contiguous(), v[:, :, :2].contiguous(), dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("sq,sk", LENGTHS, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=lambda x: str(x))
def test_lengths_and_gqa(dtype, sq, sk, causal, hq, hkv):
    d = 64
    q = randn(2, sq, hq, d, dtype=dtype)
    k, v = randn(2, sk, hkv, d, dtype=dtype), randn(2, sk, hkv, d, dtype=dtype)
    _check(q, k, v, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("window", [(0, 0), (5, 3), (16, -1), (-1, 7), (3, 0)], ids=str)
@pytest.mark.parametrize("sq,sk", [(33, 33), (20, 45), (45, 20)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(dtype, window, sq, sk, causal):
    q = randn(1, sq, 4, 32, dtype=dtype)
    k, v = randn(1, sk, 2, 32, dtype=dtype), randn(1, sk, 2, 32, dtype=dtype)
    _check(q, k, v, dtype, causal=causal, window_size=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("softcap", [1.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_and_scale(dtype, softcap, causal):
    q = randn(2, 29, 4, 48, dtype=dtype) * 3
    k, v = randn(2, 41, 4, 48, dtype=dtype), randn(2, 41, 4, 48, dtype=dtype)
    _check(q, k, v, dtype, causal=causal, softcap=softcap, softmax_scale=0.3)


def test_rows_that_see_nothing_are_zero_with_neg_inf_lse():
    # causal with Sq > Sk: the first Sq - Sk rows see no key
    q = randn(1, 20, 2, 32)
    k, v = randn(1, 5, 2, 32), randn(1, 5, 2, 32)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :15], torch.zeros_like(out[:, :15]))
    assert torch.isneginf(lse[:, :, :15]).all()
    assert not out.isnan().any() and not lse[:, :, 15:].isinf().any()


def test_very_negative_logits_pick_the_one_valid_key():
    # window (0, 0): each row sees only its own key, with a score of -5e5; out must be exactly that V
    d = 16
    q = torch.ones(1, 8, 1, d, device=randn(1).device)
    k = torch.full_like(q, -5e5 / (d * d**-0.5))
    v = randn(1, 8, 1, d)
    out = flash_attn_func(q, k, v, window_size=(0, 0))
    assert_close(out, v, torch.float32)


def test_output_written_with_noncontiguous_inputs():
    # q/k/v as strided views of one fused qkv buffer (last dim contiguous)
    qkv = randn(2, 33, 3, 4, 64)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    _check(q, k, v, torch.float32, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (7, 2)], ids=str)
def test_varlen(dtype, causal, window):
    g = torch.Generator().manual_seed(7)
    lens_q = [1, 17, 0, 33, 5, 64] if not ON_GPU else [1, 17, 0, 33, 5, 640, 1, 1000]
    lens_k = [n + int(torch.randint(0, 20, (1,), generator=g)) for n in lens_q]
    lens_k[2] = 9  # a sequence with keys but no queries
    q = randn(sum(lens_q), 6, 40, dtype=dtype)
    k, v = randn(sum(lens_k), 2, 40, dtype=dtype), randn(sum(lens_k), 2, 40, dtype=dtype)
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal,
                                      window_size=window, return_lse=True)
    ref_out, ref_lse = ref.varlen_attention_ref(q, k, v, cq, ck, causal=causal, window_size=window)
    assert lse.shape == (6, sum(lens_q))
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32 if dtype == torch.float32 else torch.float16, name="lse")


def test_varlen_equals_dense_per_sequence():
    lens = [13, 40, 1]
    q = randn(sum(lens), 4, 32)
    k, v = randn(sum(lens), 4, 32), randn(sum(lens), 4, 32)
    cu = cu_seqlens(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        dense = flash_attn_func(q[None, s:e], k[None, s:e], v[None, s:e], causal=True)[0]
        assert_close(out[s:e], dense, torch.float32, name=f"seq {b}")


@pytest.mark.skipif(not ON_GPU, reason="long sequences are for the compiled GPU run")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("n", [4096, 16384])
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequences(dtype, n, causal):
    q = randn(1, n, 2, 128, dtype=dtype)
    k, v = randn(1, n, 1, 128, dtype=dtype), randn(1, n, 1, 128, dtype=dtype)
    _check(q, k, v, dtype, causal=causal)


class _FakeCompileError(RuntimeError):
    pass


def test_compile_failure_falls_back_to_a_safe_tile(monkeypatch):
    # triton 3.6's ptxas crashes on some tiles: the launcher retries once with a conservative tile
    from pagedflash.ops import attention, attention_launch

    real, seen = attention._attention_kernel, []

    class Flaky:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append(kwargs["num_stages"])
                if kwargs["num_stages"] != 1:
                    raise _FakeCompileError("ptxas died")
                return real[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(attention, "_attention_kernel", Flaky())
    monkeypatch.setattr(attention_launch, "_COMPILE_ERRORS", (_FakeCompileError,))
    monkeypatch.setattr(attention_launch, "_FALLBACK", {})
    # 200 query rows: a prefill tile (up to PACK_MAX_ROWS = 128 rows pack into one unpipelined decode tile on a GPU)
    q, k, v = randn(1, 200, 2, 32), randn(1, 200, 2, 32), randn(1, 200, 2, 32)
    with pytest.warns(UserWarning, match="failed .*_FakeCompileError.*; using"):
        out = flash_attn_func(q, k, v, causal=True)
    assert_close(out, ref.attention_ref(q, k, v, causal=True)[0], torch.float32)
    flash_attn_func(q, k, v, causal=True)  # remembered: no second failing attempt
    assert len(seen) == 3 and seen[0] != 1 and seen[1:] == [1, 1]


@pytest.mark.parametrize("b,sq,sk", [(0, 7, 5), (2, 0, 5), (0, 0, 0)], ids=str)
def test_empty_batch_or_queries_give_empty_outputs(b, sq, sk):
    q, k, v = randn(b, sq, 4, 32), randn(b, sk, 2, 32), randn(b, sk, 2, 32)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (b, sq, 4, 32) and out.dtype == q.dtype
    assert lse.shape == (b, 4, sq) and lse.dtype == torch.float32
    given = torch.empty_like(q)
    assert flash_attn_func(q, k, v, out=given) is given


def test_no_keys_give_zero_rows_and_neg_inf_lse():
    q, k, v = randn(2, 3, 4, 32), randn(2, 0, 2, 32), randn(2, 0, 2, 32)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_zero_query_heads_are_refused_by_name():
    q, k, v = randn(2, 3, 0, 32), randn(2, 5, 2, 32), randn(2, 5, 2, 32)
    with pytest.raises(ValueError, match="heads: .*got Hq=0, Hkv=2"):
        flash_attn_func(q, k, v)

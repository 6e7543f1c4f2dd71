"""What the Gluon Hopper prefill kernel's test files (tests/test_prefill_hopper*.py) share: the sm90
marker, the fixtures that stub the routing's machine (``hopper_here``) or lift its size rule for the
small test shapes (``gluon``), and the calls that must take the Gluon kernel, checked against the
fp32 reference (dense, varlen, paged over a NaN-poisoned pool, fp8 K/V with their descales).

A test file binds a fixture to its own name (``gluon = checks.gluon``): pytest finds fixtures by
the names in the test's module.
"""

import pytest
import torch
from helpers import ON_GPU, assert_close, cu_seqlens, fp8_pool, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func
from pagedflash import reference as ref
from pagedflash.cache import cu_seqlens_tensor
from pagedflash.ops import prefill_hopper
from pagedflash.ops.utils import nvidia_capability

ON_SM90 = ON_GPU and nvidia_capability(torch.device("cuda")) == (9, 0)
sm90 = pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on NVIDIA sm90 only")


@pytest.fixture
def hopper_here(monkeypatch):
    """The routing as on an sm90 GPU with Triton 3.6, over CPU tensors (no launch happens)."""
    monkeypatch.setattr(prefill_hopper, "ENABLED", True)
    monkeypatch.setattr(prefill_hopper, "UNAVAILABLE", None)
    monkeypatch.setattr(prefill_hopper, "nvidia_capability", lambda device: (9, 0))
    monkeypatch.setattr(prefill_hopper, "num_sms", lambda device: 16)


@pytest.fixture
def gluon(monkeypatch):
    """Route the small test shapes to the Gluon kernel (those rules are about speed, not results)."""
    monkeypatch.setattr(prefill_hopper, "ENABLED", True)
    monkeypatch.setattr(prefill_hopper, "MIN_SEQLEN", dict.fromkeys(prefill_hopper.MIN_SEQLEN, 0))
    monkeypatch.setattr(prefill_hopper, "MIN_PROGRAMS_PER_SM", dict.fromkeys(prefill_hopper.MIN_PROGRAMS_PER_SM, 0))


def empty_qkv(b=1, sq=1024, sk=1024, hq=2, hkv=2, d=128, dtype=torch.bfloat16):
    """Uninitialized operands of a call the routing accepts as they are (16 programs, 16 SMs)."""
    return (torch.empty(b, sq, hq, d, dtype=dtype), torch.empty(b, sk, hkv, d, dtype=dtype),
            torch.empty(b, sk, hkv, d, dtype=dtype))


def check_gluon(q, k, v, dtype, out=None, **opts):
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


def through_gluon(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, return_lse, block_table=None, out=None,
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


def check_varlen(lens_q, lens_k, hq, hkv, d, dtype, causal, poison_last_v=False, return_lse=True, fused=False):
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
    got, lse = through_gluon(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, return_lse=return_lse,
                             out=out)
    assert out is None or got is out
    want, want_lse = ref.varlen_attention_ref(q, k, v, cu_q, cu_k, causal=causal)
    rows = int(cu_q[-2]) if poison_last_v else q.shape[0]
    assert_close(got[:rows], want[:rows], dtype)
    if return_lse:
        assert_close(lse[:, :rows], want_lse[:, :rows], torch.float16, name="lse")


def descales(kind, hkv):
    """fp8 descales: None, one for all heads (``[]``), or one per KV head (``[Hkv]``, a strided view)."""
    if kind is None:
        return None, None
    if kind == "tensor":
        return torch.tensor(0.75, device="cuda"), torch.tensor(1.5, device="cuda")
    if kind == "one":  # [1]: one for all heads too (a plan of its own beside [Hkv]'s)
        return torch.tensor([1.25], device="cuda"), torch.tensor([0.5], device="cuda")
    scales = torch.rand(2, hkv, 2, device="cuda") + 0.5
    return scales[0, :, 0], scales[1, :, 1]


def check_paged(lens_q, lens_k, page, hq, hkv, d, dtype, causal, share_first=0, return_lse=True, odd=False,
                fp8=None, descale=None):
    """A varlen call over a NaN-poisoned paged pool (:func:`helpers.make_pool`: pages in random order,
    every slot past a sequence's keys NaN) that must take the Gluon kernel, against the reference.
    ``odd``: the caches are the first D columns of wider rows (token strides past ``Hkv * D``) and
    the block table the first columns of a wider one (its row stride past its width). ``fp8``: the
    pool in that dtype (NaN in fp8 too), with ``descale`` (:func:`descales`), against the reference
    over the dequantized pool."""
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    if fp8 is None:
        k_cache, v_cache, table = make_pool(lens_k, page, hkv, d, dtype, share_first=share_first)
    else:
        k_cache, v_cache, table = fp8_pool(lens_k, page, hkv, d, fp8, share_first=share_first)
    kd, vd = descales(descale, hkv)
    if odd:
        k_cache, v_cache = (torch.nn.functional.pad(c, (0, 8), value=float("nan"))[..., :d] for c in (k_cache, v_cache))
        wide = torch.full((table.shape[0], table.shape[1] + 5), -7, dtype=torch.int32, device=table.device)
        wide[:, :table.shape[1]] = table
        table = wide[:, :table.shape[1]]
    q = randn(int(cu_q[-1]), hq, d, dtype=dtype)
    got, lse = through_gluon(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                             block_table=table, return_lse=return_lse, k_descale=kd, v_descale=vd)
    want, want_lse = ref.paged_varlen_attention_ref(q, ref.dequantize_ref(k_cache, kd), ref.dequantize_ref(v_cache, vd),
                                                    cu_q, cu_k, table, causal=causal)
    assert_close(got, want, dtype)
    if return_lse:
        assert_close(lse, want_lse, torch.float16, name="lse")

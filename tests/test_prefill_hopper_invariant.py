"""The Gluon prefill kernel's batch-invariant variant (sm90): a row's output and LSE bit for bit the
portable kernel's in the mode (dense, varlen, paged over a NaN-poisoned pool, causal or not, through
the split rule's 4,096-key head (512-key splits) and past it into its 2,048-key splits; other rules and tiles; fp8 K/V
with their descales), and so the decode step's of the same row; the switch
(``PAGEDFLASH_INVARIANT_GLUON``) decides which kernel takes the mode's calls.
Its routing on every machine: tests/test_prefill_hopper.py.
"""

import prefill_hopper_checks as checks
import pytest
import torch
from helpers import cu_seqlens, fp8_pool, ids, make_pool, randn

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from pagedflash.ops import launch, prefill_hopper

gluon = checks.gluon  # the shared fixture, found by its name here

LENS_K = [5000, 700, 2100]  # keys a sequence: past the 4,096-key head, inside it, one long split in
LENS_Q = [4500, 700, 300]  # the rows of a (last) chunk of each


def _both(call):
    """``call()`` through the Gluon kernel's variant (which must run) and through the portable
    kernel: ``(gluon's, portable's)``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill_hopper, "INVARIANT_ENABLED", True)
        before = prefill_hopper.launches
        got = call()
        assert prefill_hopper.launches == before + 1, "the Gluon kernel did not run"
        mp.setattr(prefill_hopper, "INVARIANT_ENABLED", False)
        want = call()
        assert prefill_hopper.launches == before + 1, "the Gluon kernel ran with its switch off"
    return got, want


CASES = [*((d, torch.bfloat16, True, layout) for d in (64, 128) for layout in ("dense", "varlen", "page16", "page64")),
         (128, torch.float16, False, "dense"), (64, torch.float16, True, "page64"), (128, torch.bfloat16, False, "varlen")]


@checks.sm90
@pytest.mark.parametrize(("d", "dtype", "causal", "layout"), CASES, ids=ids)
def test_rows_equal_the_portable_kernels(gluon, d, dtype, causal, layout):
    hq, hkv = 4, 2
    # 0.09: sm_scale x log2(e) rounded once from double and as an fp32 product differ (the kernel forms the latter)
    opts = dict(causal=causal, return_lse=True, batch_invariant=True, softmax_scale=0.09 if d == 128 else None)
    if layout == "dense":
        q = randn(2, LENS_Q[0], hq, d, dtype=dtype)
        k, v = randn(2, LENS_K[0], hkv, d, dtype=dtype), randn(2, LENS_K[0], hkv, d, dtype=dtype)
        (got, got_lse), (want, want_lse) = _both(lambda: flash_attn_func(q, k, v, **opts))
    else:
        lens_q = LENS_K if layout == "varlen" else LENS_Q
        q = randn(sum(lens_q), hq, d, dtype=dtype)
        if layout == "varlen":
            k, v = randn(sum(LENS_K), hkv, d, dtype=dtype), randn(sum(LENS_K), hkv, d, dtype=dtype)
            table = None
        else:
            k, v, table = make_pool(LENS_K, int(layout[4:]), hkv, d, dtype)
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(LENS_K)
        (got, got_lse), (want, want_lse) = _both(lambda: flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lens_q), max(LENS_K), block_table=table, **opts))
        if table is not None:  # each sequence's last row as a decode step of its own, all in one batch
            last = cu_q[1:].long() - 1
            lens = torch.tensor(LENS_K, dtype=torch.int32, device=q.device)
            step, step_lse = flash_attn_with_kvcache(q[last][:, None], k, v, cache_seqlens=lens, block_table=table,
                                                     causal=causal, return_lse=True, batch_invariant=True,
                                                     softmax_scale=opts["softmax_scale"])
            assert torch.equal(step[:, 0], got[last]) and torch.equal(step_lse[:, :, 0], got_lse[:, last].T)
    assert not got.isnan().any()
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


SETTINGS = {  # launch-table switches: split rules other than the default, the opt-in prefill and 128-key tiles
    "one-tile head splits": dict(INVARIANT_HEAD_KEYS=1024, INVARIANT_HEAD_SPLIT_KEYS=64),
    "no head": dict(INVARIANT_HEAD_KEYS=0),
    "middle tier": dict(INVARIANT_MID_KEYS=6144, INVARIANT_MID_SPLIT_KEYS=1024),
    "prefill tile": dict(INVARIANT_PREFILL_TILE="128:8:3"),
    "128-key tiles": dict(INVARIANT_TILE="64:128:4:2"),  # the variant's other key tile (opt-in)
}


@checks.sm90
@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_rows_equal_under_other_rules_and_tiles(gluon, monkeypatch, setting):
    """Other rules, the opt-in prefill tile (whose rows a warp the variant shares) and 128-key tiles, GQA
    groups of 4, and rows that see no key: a sequence without keys, causal rows before a shorter key range."""
    for name, value in SETTINGS[setting].items():
        monkeypatch.setattr(launch, name, value)
    hq, hkv, d, page = 8, 2, 64, 16
    lens_q, lens_k = [300, 200, 50, 1000], [5000, 0, 30, 7000]
    k, v, table = make_pool(lens_k, page, hkv, d, torch.bfloat16)
    q = randn(sum(lens_q), hq, d, dtype=torch.bfloat16)
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    (got, got_lse), (want, want_lse) = _both(lambda: flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), block_table=table, causal=True, return_lse=True,
        batch_invariant=True))
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    empty = slice(lens_q[0], lens_q[0] + lens_q[1] + 20)  # sequence 1, and sequence 2's first 20 rows
    assert not got[empty].any() and (got_lse[:, empty] == float("-inf")).all()


FP8_CASES = [  # head dim, q dtype, layout, fp8 dtype, descales (per KV head / per tensor), causal
    (64, torch.bfloat16, "page64", torch.float8_e4m3fn, "head", True),
    (128, torch.bfloat16, "page16", torch.float8_e5m2, "tensor", True),
    (128, torch.float16, "varlen", torch.float8_e4m3fn, "head", True),
    (128, torch.bfloat16, "varlen", torch.float8_e4m3fn, "tensor", False),
]


@checks.sm90
@pytest.mark.parametrize(("d", "dtype", "layout", "fp8", "descale", "causal"), FP8_CASES, ids=ids)
def test_fp8_cache_rows_equal_the_portable_kernels(gluon, monkeypatch, d, dtype, layout, fp8, descale, causal):
    """fp8 K/V under 16-bit queries (bf16 q scaled by a power of two a row, the descales in the portable
    kernel's order, a softmax scale whose products round differently in another order); the variant takes
    them with INVARIANT_FP8 (on by default, and here). Under bf16, some tokens of one head and every token
    of another head of a KV group are 2^24 times larger: a shift a tile, not a row, would move the others'
    bits."""
    monkeypatch.setattr(prefill_hopper, "INVARIANT_FP8", True)
    hq, hkv = 8, 2
    q = randn(sum(LENS_Q), hq, d) * 3
    if dtype == torch.bfloat16:  # (fp16 q is not shifted, and would overflow)
        q[::7, 0::4] *= 2.0**24  # (never both: scores past ~2^31 overflow exp2(fma(s, scale, -max)) in any kernel)
        q[:, 1::4] *= 2.0**24
    q = q.to(dtype)
    if layout == "varlen":  # packed fp8 K/V, NaN-free
        k, v = (randn(sum(LENS_K), hkv, d).to(fp8) for _ in range(2))
        table = None
    else:
        k, v, table = fp8_pool(LENS_K, int(layout[4:]), hkv, d, fp8)
    if descale == "head":
        kd, vd = torch.rand(2, hkv, device=q.device) + 0.5
    else:
        kd, vd = torch.tensor(0.7, device=q.device), torch.tensor([1.3], device=q.device)
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    opts = dict(softmax_scale=0.09, k_descale=kd, v_descale=vd, return_lse=True, batch_invariant=True)
    (got, got_lse), (want, want_lse) = _both(lambda: flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), block_table=table, causal=causal, **opts))
    assert not got.isnan().any()
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    if table is not None:  # each sequence's last row as a decode step, all in one batch
        last = cu_q[1:].long() - 1
        lens = torch.tensor(LENS_K, dtype=torch.int32, device=q.device)
        step, step_lse = flash_attn_with_kvcache(q[last][:, None], k, v, cache_seqlens=lens, block_table=table,
                                                 causal=causal, **opts)
        assert torch.equal(step[:, 0], got[last]) and torch.equal(step_lse[:, :, 0], got_lse[:, last].T)

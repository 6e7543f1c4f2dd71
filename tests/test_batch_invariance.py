"""Batch-invariant mode of the attention kernels (:mod:`pagedflash.batch_invariance`): a query row's
output and LSE bit for bit the same however the call around it is made up — alone or among other
sequences of other lengths, as part of a whole prefill, of a chunk of any size, or as a decode step,
with any split count — for every option the engine uses (GQA, sliding window, softcap, sinks, fp8
caches with descales), and still the attention of the fp32 reference; and the fused MoE's rows.

Under the interpreter the dot runs through :func:`pagedflash.testing.row_exact_interpreter_dot` (the
host BLAS rounds an element by its row's place in a block; a GPU's dot instruction does not).
"""

import pagedflash  # noqa: F401, I001  (first: sets TRITON_INTERPRET on CPU-only machines)
import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import DEVICE, DTYPES, ON_GPU, assert_close, cu_seqlens, fp8_pool, ids, make_pool, randn
from pagedflash import batch_invariance, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, validate
from pagedflash.engine.executor import graph_split_bytes
from pagedflash.engine.runner import graph_num_splits, graph_sizes
from pagedflash.ops import attention, attention_launch, attention_plan, launch, moe
from pagedflash.ops.combine import launch_combine, plan_combine
from pagedflash.ops.utils import cdiv, fp8_cvt_device, interpreted, num_sms
from pagedflash.reference import paged_varlen_attention_ref
from pagedflash.testing import row_exact_interpreter_dot

PAGE = 16
LEN = 100 if not ON_GPU else 5000  # several invariant splits of each size (launch.SplitRule: head and long)
OTHERS = [37, 8, 70] if not ON_GPU else [3000, 17, 9000]


@pytest.fixture(autouse=True)
def exact_dot():
    with row_exact_interpreter_dot():
        yield


def _varlen(q, caches, table, lens_q, lens_k, opts, num_splits=0, max_seqlen_k=None):
    """The paged varlen call the engine makes: each sequence's new rows attend its first lens_k keys
    (``max_seqlen_k``: a bound past the longest, as a decode graph's)."""
    k_cache, v_cache = caches
    out, lse = flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max_seqlen_k or max(lens_k),
        causal=True,
        block_table=table, num_splits=num_splits, return_lse=True, batch_invariant=True, **opts)
    return out, lse


CASES = {
    "plain": dict(hq=4, hkv=2, d=32, opts={}),
    "mqa_window_softcap": dict(hq=4, hkv=1, d=48, opts=dict(window_size=(40, 0), softcap=20.0)),
    "sinks": dict(hq=2, hkv=2, d=32, opts=dict(sinks=True)),
}


def _setup(case, dtype, fp8=False):
    c = CASES[case]
    lens = [LEN, *OTHERS]
    if fp8:
        k_cache, v_cache, table = fp8_pool(lens, PAGE, c["hkv"], c["d"])
        scale = torch.full((c["hkv"],), 0.5, device=DEVICE)
        c = dict(c, opts=dict(c["opts"], k_descale=scale, v_descale=scale * 1.5))
    else:
        k_cache, v_cache, table = make_pool(lens, PAGE, c["hkv"], c["d"], dtype)
    opts = dict(c["opts"])
    if opts.pop("sinks", False):
        opts["sinks"] = randn(c["hq"]) * 2
    q = randn(LEN, c["hq"], c["d"], dtype=dtype)
    q_others = [randn(n, c["hq"], c["d"], dtype=dtype) for n in OTHERS]
    return (k_cache, v_cache), table, q, q_others, opts


MATRIX = [(case, dtype) for case in CASES for dtype in (DTYPES if case == "plain" or ON_GPU else DTYPES[:1])]


@pytest.mark.parametrize(("case", "dtype"), MATRIX, ids=lambda v: ids(v))
def test_rows_equal_however_the_call_is_made_up(case, dtype):
    check_rows_equal(case, dtype)


@pytest.mark.parametrize(("case", "dtype"), [("plain", DTYPES[-1]), ("mqa_window_softcap", DTYPES[-1])],
                         ids=lambda v: ids(v))
def test_rows_equal_with_a_prefill_tile(monkeypatch, case, dtype):
    """PAGEDFLASH_INVARIANT_PREFILL_TILE: prefill and chunks of more than one row run twice the rows a
    tile (under the interpreter 32, on the GPU 128 with 8 warps), decode rows the mode's tile: a
    row's bits must not change."""
    monkeypatch.setattr(launch, "INVARIANT_PREFILL_TILE", "128:8:3" if ON_GPU else "32:4:1")
    attention.clear_plans()  # only this test's plans below
    check_rows_equal(case, dtype)
    rows = {plan.cfg.block_m for plan in attention._PLANS.values() if plan.consts.get("INVARIANT")}
    tiles = {128, 64} if ON_GPU else {32, 16}
    assert tiles <= rows <= tiles | {16}, rows  # 16: the one-warp decode tile, where a launch takes it


@pytest.mark.skipif(not ON_GPU, reason="the GPU's MMA instructions (the interpreter's tile has 16 rows)")
@pytest.mark.parametrize(("case", "dtype"), [("plain", DTYPES[-1]), ("mqa_window_softcap", DTYPES[-1]),
                                             ("sinks", DTYPES[-1])], ids=lambda v: ids(v))
def test_rows_equal_with_a_decode_tile(monkeypatch, case, dtype):
    """The decode tile (16:1:2) for every decode launch (PAGEDFLASH_INVARIANT_DECODE_WAVES=0): decode rows
    run one warp's 16 rows (the warp's MMA), prefill and chunks the mode's 64 rows of 4 warps (a
    warpgroup's): a row's bits must not change."""
    monkeypatch.setattr(launch, "INVARIANT_DECODE_WAVES", 0)
    attention.clear_plans()  # only this test's plans below
    check_rows_equal(case, dtype)
    rows = {plan.cfg.block_m for plan in attention._PLANS.values() if plan.consts.get("INVARIANT")}
    assert rows == {16, 64}, rows


@pytest.mark.skipif(not (ON_GPU and fp8_cvt_device(torch.device(DEVICE))),
                    reason="the GPU's MMA instructions and its fp8 conversion (NVIDIA sm_89+)")
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_fp8_rows_equal_with_a_decode_tile(monkeypatch, dtype):
    """The decode tile over fp8 K/V for every decode launch: a decode step's row, alone and batched, as
    the whole prefill's (the mode's 64-row tile), its K converted as the 16-bit layout's (bf16 q scaled
    per row)."""
    monkeypatch.setattr(launch, "INVARIANT_DECODE_WAVES_FP8", 0)
    attention.clear_plans()
    caches, table, q, q_others, opts = _setup("plain", dtype, fp8=True)
    full, full_lse = _varlen(q, caches, table[:1], [LEN], [LEN], opts)
    for t in (5, 300, LEN - 1):
        alone, alone_lse = _varlen(q[t:t + 1], caches, table[:1], [1], [t + 1], opts)
        assert torch.equal(alone[0], full[t]) and torch.equal(alone_lse[:, 0], full_lse[:, t]), f"decode {t}"
        out, lse = _varlen(torch.cat([q_others[2][-1:], q[t:t + 1]]), caches, table[[3, 0]], [1, 1],
                           [OTHERS[2], t + 1], opts)
        assert torch.equal(out[1], full[t]) and torch.equal(lse[:, 1], full_lse[:, t]), f"batched decode {t}"
    rows = {plan.cfg.block_m for plan in attention._PLANS.values() if plan.consts.get("INVARIANT")}
    assert rows == {16, 64}, rows


@pytest.mark.skipif(ON_GPU, reason="the interpreter's rule; the GPU runs its default rule above")
@pytest.mark.parametrize("rule", [(32, 0, 32), (64, 48, 16), (48, 32, 16, 64, 32), (32, 0, 32, 64, 16)],
                         ids=["no_head", "head_48_of_16", "mid_to_64_of_32", "mid_of_16_no_head"])
def test_rows_equal_under_another_split_rule(monkeypatch, rule):
    """Any split rule keeps the promise (no head: PAGEDFLASH_INVARIANT_HEAD_KEYS=0, long splits only; a
    head that ends inside a long split's span; a middle tier after a head, and without one): (keys, head
    keys, head split[, middle tier's end, its split]) as the interpreter's."""
    monkeypatch.setattr(launch, "INTERPRET_SPLIT_RULE", rule)  # a plan switch: no other rule's plan is reused
    check_rows_equal("sinks", DTYPES[-1])


def check_rows_equal(case, dtype):
    """A row's output and LSE as a whole prefill's, a chunk's of 1, 7 and 40 rows beside other
    sequences, a decode step's alone, split 1 and 5 ways, and batched (the module doc)."""
    caches, table, q, q_others, opts = _setup(case, dtype)
    # the whole prefill alone: every row's canonical value, and the reference's
    full, full_lse = _varlen(q, caches, table[:1], [LEN], [LEN], opts)
    k_ref, v_ref = caches
    ref, ref_lse = paged_varlen_attention_ref(q, k_ref, v_ref, cu_seqlens([LEN]), cu_seqlens([LEN]), table[:1],
                                              causal=True, **opts)
    assert_close(full, ref, dtype)
    assert_close(full_lse, ref_lse, torch.float32, name="lse")

    # chunked prefill: chunks of several sizes, each alongside the other sequences' whole prefills
    for chunk in (1, 7, 40):
        start = LEN - chunk - 3
        rows = q[start:start + chunk]
        batch_q = torch.cat([q_others[0], rows, q_others[1]])
        out, lse = _varlen(batch_q, caches, table[[1, 0, 2]], [OTHERS[0], chunk, OTHERS[1]],
                           [OTHERS[0], start + chunk, OTHERS[1]], opts)
        mine = slice(OTHERS[0], OTHERS[0] + chunk)
        assert torch.equal(out[mine], full[start:start + chunk]), f"chunk {chunk}"
        assert torch.equal(lse[:, mine], full_lse[:, start:start + chunk]), f"chunk {chunk} lse"

    # decode steps: alone, with forced split counts, and in a batch of decodes of other lengths
    for t in (0, 32, LEN - 1):
        alone, alone_lse = _varlen(q[t:t + 1], caches, table[:1], [1], [t + 1], opts)
        assert torch.equal(alone[0], full[t]) and torch.equal(alone_lse[:, 0], full_lse[:, t]), f"decode {t}"
        for splits in (1, 5):
            out, lse = _varlen(q[t:t + 1], caches, table[:1], [1], [t + 1], opts, num_splits=splits)
            assert torch.equal(out[0], full[t]) and torch.equal(lse[:, 0], full_lse[:, t]), f"{splits} splits"
        with pytest.MonkeyPatch.context() as mp:  # the splits shared by 2-3 programs (a GPU of 1 SM, 3 waves)
            mp.setattr(attention_plan, "num_sms", lambda device: 1)
            mp.setattr(launch, "INVARIANT_SPLIT_WAVES", 3)  # a plan key of its own (no other call's plan)
            before = {id(plan) for plan in attention._PLANS.values()}
            out, lse = _varlen(q[t:t + 1], caches, table[:1], [1], [t + 1], opts, num_splits=5)
            slots = launch.invariant_split_rule(interpreted(), q.shape[-1]).count(t + 1)
            programs = min(slots, -(-3 // CASES[case]["hkv"]))  # 3 programs over the KV heads' programs
            new = {plan.grid[2] for plan in attention._PLANS.values() if id(plan) not in before}
            assert new <= {programs}, new  # (none new: kept from an earlier call of this signature)
        assert torch.equal(out[0], full[t]) and torch.equal(lse[:, 0], full_lse[:, t]), f"decode {t}, shared splits"
        batch_q = torch.cat([q_others[2][-1:], q[t:t + 1], q_others[0][-1:]])
        out, lse = _varlen(batch_q, caches, table[[3, 0, 1]], [1, 1, 1], [OTHERS[2], t + 1, OTHERS[0]], opts)
        assert torch.equal(out[1], full[t]) and torch.equal(lse[:, 1], full_lse[:, t]), f"batched decode {t}"


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=ids)
def test_fp8_cache_rows_equal(dtype):
    """fp8 K/V under 16-bit queries (bf16 queries scale q per row in the mode: GPU only)."""
    caches, table, q, q_others, opts = _setup("plain", dtype, fp8=True)
    full, full_lse = _varlen(q, caches, table[:1], [LEN], [LEN], opts)
    for t in (5, LEN - 1):
        out, lse = _varlen(torch.cat([q_others[1][:2], q[t:t + 1]]), caches, table[[2, 0]], [2, 1],
                           [OTHERS[1], t + 1], opts, num_splits=4)
        assert torch.equal(out[2], full[t]) and torch.equal(lse[:, 2], full_lse[:, t])


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_entry_points_agree(dtype):
    """The same rows through the dense, KV-cache (contiguous and paged) and varlen entry points."""
    hq, hkv, d, n = 4, 2, 32, 70
    k, v = randn(1, n, hkv, d, dtype=dtype), randn(1, n, hkv, d, dtype=dtype)
    q = randn(1, n, hq, d, dtype=dtype)
    dense, dense_lse = flash_attn_func(q, k, v, causal=True, return_lse=True, batch_invariant=True)
    varlen, varlen_lse = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens([n]), cu_seqlens([n]), n, n, causal=True,
                                                return_lse=True, batch_invariant=True)
    assert torch.equal(dense[0], varlen) and torch.equal(dense_lse[0], varlen_lse)
    # decode of the last row against a contiguous cache with room to spare, and split
    cache_k = torch.zeros(2, 96, hkv, d, dtype=dtype, device=DEVICE)
    cache_v = torch.zeros_like(cache_k)
    cache_k[1, :n], cache_v[1, :n] = k[0], v[0]
    lens = torch.tensor([5, n], dtype=torch.int32, device=DEVICE)
    q2 = torch.cat([randn(1, 1, hq, d, dtype=dtype), q[:, -1:]])
    for splits in (0, 1, 4):
        out, lse = flash_attn_with_kvcache(q2, cache_k, cache_v, cache_seqlens=lens, num_splits=splits,
                                           return_lse=True, batch_invariant=True)
        assert torch.equal(out[1, 0], dense[0, -1]) and torch.equal(lse[1, :, 0], dense_lse[0, :, -1])


def test_default_mode_and_switch():
    assert not batch_invariance.is_batch_invariant()
    with pagedflash.batch_invariant():
        assert batch_invariance.resolve(None) is True
        assert batch_invariance.resolve(False) is False
        with pagedflash.batch_invariant(False):
            assert not pagedflash.is_batch_invariant()
        assert pagedflash.is_batch_invariant()
    assert not pagedflash.is_batch_invariant()
    pagedflash.set_batch_invariant(True)
    try:
        assert pagedflash.is_batch_invariant()
    finally:
        pagedflash.set_batch_invariant(False)
    with pytest.raises(TypeError, match="batch_invariant: expected a bool"):
        pagedflash.set_batch_invariant(1)
    q = randn(1, 4, 2, 32)
    with pytest.raises(TypeError, match="batch_invariant"):
        flash_attn_func(q, q, q, batch_invariant="yes")


def test_global_switch_reaches_the_kernels():
    """The process-wide default changes the result's rounding path, not its value."""
    caches, table, q, _, opts = _setup("plain", torch.float32)
    k_cache, v_cache = caches
    call = lambda **kw: flash_attn_varlen_func(  # noqa: E731
        q[-1:], k_cache, v_cache, cu_seqlens([1]), cu_seqlens([LEN]), 1, LEN, causal=True, block_table=table[:1], **kw)
    with pagedflash.batch_invariant():
        by_default = call()
    assert torch.equal(by_default, call(batch_invariant=True))
    assert_close(call(), by_default, torch.float32)


def test_fused_moe_rows_equal():
    """The experts' rows: a token alone (one pair per block, decode tiles by default) and among 69 others (grouped by expert, prefill tiles by default)."""
    T, H, I, E, k = 70, 160, 136, 4, 2  # H and I past both tiles' reduction steps (128, 64)
    hidden = randn(T, H)
    w13, w2 = randn(E, 2 * I, H) * 0.2, randn(E, H, I) * 0.2
    weights, ids = moe.route(randn(T, E), k, scoring="softmax", renormalize=True)
    assert not moe.tiles(T, k, E).direct and moe.tiles(1, k, E).direct
    batch = moe.fused_moe(hidden, w13, w2, weights, ids, batch_invariant=True)
    for t in (0, 20, T - 1):
        one = moe.fused_moe(hidden[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], batch_invariant=True)
        assert torch.equal(one[0], batch[t]), f"token {t}"


def test_invariant_tile_setting(monkeypatch):
    monkeypatch.setattr(launch, "INVARIANT_TILE", "")
    # the default: 64:64:4:3 up to D = 128 with 164+ KB of shared memory, a stage fewer above or with less
    for d, cap, stages in ((64, (9, 0), 3), (128, (9, 0), 3), (256, (9, 0), 2), (128, (8, 0), 3), (128, (8, 9), 2),
                           (256, (12, 0), 1)):
        cfg = launch.invariant_config(group=4, head_dim=d, capability=cap, interpreted=False)
        assert (cfg.block_m, cfg.block_n, cfg.g_pack, cfg.num_warps, cfg.num_stages) == (64, 64, 4, 4, stages)
    monkeypatch.setattr(launch, "INVARIANT_TILE", "32:64:4:3")
    cfg = launch.invariant_config(group=4, head_dim=256, capability=(8, 9), interpreted=False)
    assert (cfg.block_m, cfg.block_n, cfg.g_pack, cfg.num_warps, cfg.num_stages) == (32, 64, 4, 4, 3)
    # 8 rows a warp: the default decode tile (16 a warp) is left unused, not refused
    assert launch.invariant_config(group=4, head_dim=256, capability=(8, 9), interpreted=False,
                                   decode_programs=10**6, sms=1).block_m == 32
    assert launch.invariant_config(group=3, head_dim=128, capability=(9, 0), interpreted=False).g_pack == 1
    for bad in ("64:32:4", "48:32:4:1", "64:8:4:1", "a:b:c:d", "64:32:4:0"):
        monkeypatch.setattr(launch, "INVARIANT_TILE", bad)
        with pytest.raises(ValueError, match="PAGEDFLASH_INVARIANT_TILE: expected rows:keys:warps:stages"):
            launch.invariant_config(group=1, head_dim=128, capability=(9, 0), interpreted=False)
    monkeypatch.setattr(launch, "INVARIANT_TILE", "")
    monkeypatch.setattr(launch, "INVARIANT_PREFILL_TILE", "128:8:2")  # prefill only; keys stay the tile's
    cfg = launch.invariant_config(group=4, head_dim=128, capability=(9, 0), interpreted=False, prefill=True)
    assert (cfg.block_m, cfg.block_n, cfg.g_pack, cfg.num_warps, cfg.num_stages) == (128, 64, 4, 8, 2)
    cfg = launch.invariant_config(group=4, head_dim=128, capability=(9, 0), interpreted=False)
    assert (cfg.block_m, cfg.num_warps, cfg.num_stages) == (64, 4, 3)
    monkeypatch.setattr(launch, "INVARIANT_PREFILL_TILE", "128:8:3")  # D = 256: the tile's 2 stages at most
    cfg = launch.invariant_config(group=1, head_dim=256, capability=(9, 0), interpreted=False, prefill=True)
    assert (cfg.block_m, cfg.num_warps, cfg.num_stages) == (128, 8, 2)
    for bad in ("128:8", "96:8:2", "128:6:2", "128:8:0", "x"):
        monkeypatch.setattr(launch, "INVARIANT_PREFILL_TILE", bad)
        with pytest.raises(ValueError, match="PAGEDFLASH_INVARIANT_PREFILL_TILE: expected rows:warps:stages"):
            launch.invariant_config(group=1, head_dim=128, capability=(9, 0), interpreted=False, prefill=True)
    for other in ("128:4:3", "32:2:1", "256:8:2"):  # 32 rows a warp; no warpgroup (mma.sync); 32 rows a warp
        monkeypatch.setattr(launch, "INVARIANT_PREFILL_TILE", other)
        with pytest.raises(ValueError, match="PAGEDFLASH_INVARIANT_PREFILL_TILE: expected the mode's tile's 16 rows "):
            launch.invariant_config(group=1, head_dim=128, capability=(9, 0), interpreted=False, prefill=True)
    monkeypatch.setattr(launch, "INVARIANT_PREFILL_TILE", "")
    # decode launches of at least INVARIANT_DECODE_WAVES (8) programs an SM (1 where they split a row): one warp's 16 rows
    assert (launch.INVARIANT_DECODE_TILE, launch.INVARIANT_DECODE_WAVES, launch.INVARIANT_DECODE_WAVES_SPLIT) == \
        ("16:1:2", 8, 1)
    wide = dict(capability=(9, 0), interpreted=False, decode_programs=8 * 132, sms=132)
    cfg = launch.invariant_config(group=4, head_dim=64, **wide)
    assert (cfg.block_m, cfg.block_n, cfg.g_pack, cfg.num_warps, cfg.num_stages) == (16, 64, 4, 1, 2)
    for narrow in (dict(wide, decode_programs=8 * 132 - 1), dict(wide, decode_programs=0), dict(wide, prefill=True)):
        cfg = launch.invariant_config(group=4, head_dim=64, **narrow)
        assert (cfg.block_m, cfg.num_warps) == (64, 4)
    # over fp8 K/V from half a wave (INVARIANT_DECODE_WAVES_FP8)
    assert launch.INVARIANT_DECODE_WAVES_FP8 == 0.5
    assert launch.invariant_config(group=4, head_dim=128, **dict(wide, decode_programs=66), fp8=True).block_m == 16
    assert launch.invariant_config(group=4, head_dim=128, **dict(wide, decode_programs=65), fp8=True).block_m == 64
    # a launch that splits a row's keys from one wave (INVARIANT_DECODE_WAVES_SPLIT)
    assert launch.invariant_config(group=4, head_dim=64, **dict(wide, decode_programs=132), split=True).block_m == 16
    assert launch.invariant_config(group=4, head_dim=64, **dict(wide, decode_programs=131), split=True).block_m == 64
    cfg = launch.invariant_config(group=4, head_dim=64, capability=None, interpreted=True, decode_programs=10**6,
                                  sms=16)
    assert (cfg.block_m, cfg.num_warps, cfg.num_stages) == (16, 4, 1)  # the interpreter's tile
    assert launch.invariant_config(group=4, head_dim=64, **dict(wide, capability=None)).block_m == 64  # not NVIDIA
    assert launch.invariant_config(group=32, head_dim=64, **wide).block_m == 64  # a group past its 16 rows
    assert launch.invariant_config(group=1, head_dim=256, **dict(wide, capability=(8, 9))).num_stages == 1
    for bad, why in (("16:2:2", "the mode's tile's 16 rows a warp"), ("16:1", "rows:warps:stages")):
        monkeypatch.setattr(launch, "INVARIANT_DECODE_TILE", bad)
        for programs in (8 * 132, 1):  # checked whether a call takes it or not
            with pytest.raises(ValueError, match=f"PAGEDFLASH_INVARIANT_DECODE_TILE: expected {why}"):
                launch.invariant_config(group=1, head_dim=128, **dict(wide, decode_programs=programs))
    monkeypatch.setattr(launch, "INVARIANT_DECODE_TILE", "")  # none: the tile for every call
    assert launch.invariant_config(group=4, head_dim=64, **wide).block_m == 64


def test_no_compile_fallback_in_the_mode(monkeypatch):
    """Another tile would round rows another way: a tile that does not compile is an error."""

    class Broken:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise _FakeCompileError("ptxas died")
            return run

    monkeypatch.setattr(attention, "_attention_kernel", Broken())
    monkeypatch.setattr(attention_launch, "_COMPILE_ERRORS", (_FakeCompileError,))
    monkeypatch.setattr(attention_launch, "_FALLBACK", {})
    attention.clear_plans()
    q = randn(1, 5, 2, 32)
    with pytest.raises(RuntimeError, match="batch-invariant tile .* does not compile here .*PAGEDFLASH_INVARIANT_TILE"):
        flash_attn_func(q, q, q, causal=True, batch_invariant=True)
    attention.clear_plans()


class _FakeCompileError(RuntimeError):
    pass


# ---------------------------------------------------------------- split programs (INVARIANT_MAX_SPLITS, _SPLIT_STATES)


def _split_switches(monkeypatch, most=None, states=None):
    """The mode's split cap (``most``; None: the default) and partial-state budget (None: none)."""
    monkeypatch.setattr(launch, "INVARIANT_MAX_SPLITS", most or launch.INVARIANT_MAX_SPLITS_DEFAULT)
    monkeypatch.setattr(launch, "INVARIANT_SPLIT_STATES", states)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_rows_equal_with_many_split_programs(monkeypatch, paged):
    """A decode row of the rule's head splits and 11 more: one program for all of them (the budget
    forces it), one program a split, head + 200 splits (a bound as a decode graph's; the combine's LSE
    scan in one load and four at a time) shared by the default programs, by 1 wave of programs, 3, one
    a split, 2 (a GPU of one SM) or folded by one, past a cap of head + 199, and beside a row of head + 22 splits (trailing empty splits
    in the combine) at and past the budget: the same bits."""
    hq, hkv, d, dtype = 4, 2, 32, DTYPES[-1]
    rule = launch.invariant_split_rule(interpreted(), d)
    head = rule.count(rule.head_keys) if rule.head_keys else 0  # splits of the head
    keys = rule.keys
    n, long, bound = (rule.head_keys + k for k in (10 * keys + 20, 22 * keys, 200 * keys))
    assert [rule.count(x) for x in (n, long, bound)] == [head + 11, head + 22, head + 200]
    q = randn(2, hq, d, dtype=dtype)
    if paged:
        k_cache, v_cache, table = make_pool([n, long], PAGE, hkv, d, dtype)
        caches = (k_cache, v_cache)
    else:
        cache_k, cache_v = randn(2, bound, hkv, d, dtype=dtype), randn(2, bound, hkv, d, dtype=dtype)

    def decode(rows, lens, max_seqlen_k, splits):
        attention.clear_plans()
        if paged:
            out, lse = _varlen(q[rows], caches, table[rows], [1] * len(rows), lens, {}, num_splits=2,
                               max_seqlen_k=max_seqlen_k)
        else:
            out, lse = flash_attn_with_kvcache(
                q[rows, None], cache_k[rows, :max_seqlen_k], cache_v[rows, :max_seqlen_k],
                cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE), num_splits=2, return_lse=True,
                batch_invariant=True)
            out, lse = out[:, 0], lse[:, :, 0].T
        got = {plan.num_splits for plan in attention._PLANS.values() if plan.consts["INVARIANT"]}
        assert got == {splits}, (rows, lens, max_seqlen_k, got)
        return out[0], lse[:, 0]

    try:
        _split_switches(monkeypatch, most=1024, states=1)
        one = decode([0], [n], n, 1)
        _split_switches(monkeypatch, most=1024)
        for max_seqlen_k, splits in ((n, head + 11), (bound, head + 200)):
            assert all(map(torch.equal, decode([0], [n], max_seqlen_k, splits), one)), f"{splits} splits"
        for states, splits in (((head + 22) * 2 * hq, head + 22), ((head + 22) * 2 * hq - 1, 1)):
            _split_switches(monkeypatch, most=1024, states=states)
            assert all(map(torch.equal, decode([0, 1], [n, long], long, splits), one)), f"batched, {splits} splits"
        _split_switches(monkeypatch, most=1024)
        sms = num_sms(torch.device(DEVICE))
        for waves in (1, 3, 10**6):  # 2 programs (KV heads) a wave's sms programs
            monkeypatch.setattr(launch, "INVARIANT_SPLIT_WAVES", waves)
            assert all(map(torch.equal, decode([0], [n], bound, head + 200), one)), f"{waves} waves"
            assert {plan.grid[2] for plan in attention._PLANS.values()} == {min(head + 200, -(-waves * sms // 2))}
        monkeypatch.setattr(attention_plan, "num_sms", lambda device: 1)  # a GPU of one SM
        for waves, programs in ((1, 1), (4, 2)):  # one program a row folds the splits: no split launch
            monkeypatch.setattr(launch, "INVARIANT_SPLIT_WAVES", waves)
            assert all(map(torch.equal, decode([0], [n], bound, head + 200 if programs > 1 else 1), one))
            assert {plan.grid[2] for plan in attention._PLANS.values()} == {programs}
        monkeypatch.setattr(attention_plan, "num_sms", num_sms)
        monkeypatch.setattr(launch, "INVARIANT_SPLIT_WAVES", 2)
        _split_switches(monkeypatch, most=head + 199)
        assert all(map(torch.equal, decode([0], [n], bound, 1), one)), "past the cap"
    finally:
        attention.clear_plans()


def test_split_rule():
    """Head splits, then long ones; a row of no keys has one split."""
    rule = launch.SplitRule(keys=32, head_keys=64, head_split=16)
    assert [rule.count(n) for n in (0, 1, 16, 17, 64, 65, 96, 97, 340)] == [1, 1, 1, 2, 4, 5, 5, 6, 13]
    assert [launch.SplitRule(32).count(n) for n in (1, 32, 33, 340)] == [1, 1, 2, 11]
    default = launch.SplitRule(2048, 4096, 512)  # the GPU's: 128K keys in 70 splits, the default cap ~1M keys
    assert [default.count(n) for n in (1024, 4096, 4097, 131072, 1036288, 1036289)] == [2, 8, 9, 70, 512, 513]
    assert launch.INVARIANT_MAX_SPLITS_DEFAULT == 512
    mid = launch.SplitRule(keys=48, head_keys=32, head_split=16, mid_keys=96, mid_split=32)  # 0 16 32 64 96 144
    assert [mid.count(n) for n in (0, 16, 17, 32, 33, 64, 65, 96, 97, 144, 145)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    assert [mid.start(s) for s in range(7)] == [0, 16, 32, 64, 96, 144, 192]
    assert [default.start(s) for s in (0, 7, 8, 9)] == [0, 3584, 4096, 6144]
    assert launch.SplitRule(32, mid_keys=64, mid_split=16).count(100) == 4 + 2  # no head: 16s to 64, then 32s
    for name, env, match in (("PAGEDFLASH_INVARIANT_SPLIT_KEYS", "INVARIANT_SPLIT_KEYS", "positive multiple of 64"),
                             ("PAGEDFLASH_INVARIANT_HEAD_SPLIT_KEYS", "INVARIANT_HEAD_SPLIT_KEYS", "multiple of 64"),
                             ("PAGEDFLASH_INVARIANT_HEAD_KEYS", "INVARIANT_HEAD_KEYS", "multiple of")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(launch, env, 100)
            with pytest.raises(ValueError, match=f"{name}: expected .*{match}.*got 100"):
                launch.invariant_split_rule(False, 64)


def test_split_cap_and_budget(monkeypatch):
    rule = launch.SplitRule(32)
    _split_switches(monkeypatch, most=launch.MAX_SPLITS)  # 128 splits, no budget
    assert launch.invariant_num_splits(340, rule, 8) == 11
    assert launch.invariant_num_splits(32 * launch.MAX_SPLITS, rule, 10**6) == launch.MAX_SPLITS
    assert launch.invariant_num_splits(32 * launch.MAX_SPLITS + 1, rule, 1) == 1
    for most, states, splits in ((10, None, 1), (11, None, 11), (512, 88, 11), (512, 87, 1)):
        _split_switches(monkeypatch, most=most, states=states)
        assert launch.invariant_num_splits(340, rule, 8) == splits, (most, states)
    _split_switches(monkeypatch, most=512)
    assert launch.invariant_num_splits(32 * 512, rule, 8) == 512 and launch.invariant_num_splits(32 * 512 + 1, rule, 8) == 1


def test_split_switches_from_the_environment(monkeypatch):
    """Read when the module loads (a fresh copy of it, so that the module every other test uses keeps
    its values); a bad value is an error naming its variable."""
    def fresh():
        spec = importlib.util.spec_from_file_location("launch_copy", launch.__file__)
        copy = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "launch_copy", copy)  # its dataclasses resolve annotations there
        spec.loader.exec_module(copy)
        return copy

    rule_vars = ("PAGEDFLASH_INVARIANT_SPLIT_KEYS", "PAGEDFLASH_INVARIANT_HEAD_KEYS", "PAGEDFLASH_INVARIANT_HEAD_SPLIT_KEYS")
    for name in ("PAGEDFLASH_INVARIANT_MAX_SPLITS", "PAGEDFLASH_INVARIANT_SPLIT_STATES", *rule_vars):
        monkeypatch.delenv(name, raising=False)
    copy = fresh()
    assert copy.INVARIANT_MAX_SPLITS == 512 and copy.INVARIANT_SPLIT_STATES is None
    assert copy.invariant_split_rule(False, 64) == copy.SplitRule(2048, 4096, 512)
    for name, value, rule in zip(rule_vars, ("1024", "0", "128"), ((1024, 4096, 512), (1024, 0, 1024), (1024, 0, 1024))):
        monkeypatch.setenv(name, value)  # each on top of the ones before (no head: its split size unused)
        copy = fresh()
        assert copy.invariant_split_rule(False, 64) == copy.SplitRule(*rule), name
    for name, bad, bound in ((rule_vars[0], "0", "of 1 or more"), (rule_vars[1], "-64", "of 0 or more"),
                             (rule_vars[2], "x", "of 1 or more")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}: expected an integer {bound}, got '{bad}'"):
            fresh()
        monkeypatch.delenv(name)
    mid_vars = ("PAGEDFLASH_INVARIANT_MID_KEYS", "PAGEDFLASH_INVARIANT_MID_SPLIT_KEYS")
    for name in mid_vars:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_HEAD_KEYS", "4096")
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_HEAD_SPLIT_KEYS", "256")
    monkeypatch.setenv(mid_vars[0], "32768")  # the middle tier's splits: 1,024 keys by default
    copy = fresh()
    assert copy.invariant_split_rule(False, 64) == copy.SplitRule(2048, 4096, 256, 32768, 1024)
    for name, bad, match in ((mid_vars[0], "5000", "plus a positive multiple of .*MID_SPLIT_KEYS \\(1024\\)"),
                             (mid_vars[0], "4096", "plus a positive multiple"), (mid_vars[1], "100", "multiple of 64")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(name, bad)
            with pytest.raises(ValueError, match=f"{name}: expected .*{match}.*got {bad}"):
                fresh().invariant_split_rule(False, 64)
    for name in (*mid_vars, *rule_vars):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_MAX_SPLITS", "512")
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_SPLIT_STATES", "65536")
    copy = fresh()
    assert copy.INVARIANT_MAX_SPLITS == 512 and copy.INVARIANT_SPLIT_STATES == 65536
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_MAX_SPLITS", "0")
    with pytest.raises(ValueError, match="PAGEDFLASH_INVARIANT_MAX_SPLITS: expected an integer from 1 to 65535, got '0'"):
        fresh()
    for bad in ("-3", "x", "1.5", "65536"):
        monkeypatch.setenv("PAGEDFLASH_INVARIANT_MAX_SPLITS", bad)
        with pytest.raises(ValueError, match="PAGEDFLASH_INVARIANT_MAX_SPLITS: expected an integer from 1 to 65535"):
            launch.env_count("PAGEDFLASH_INVARIANT_MAX_SPLITS", launch.MAX_SPLITS, launch.MAX_GRID_SPLITS)
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_SPLIT_STATES", "0")
    with pytest.raises(ValueError, match="PAGEDFLASH_INVARIANT_SPLIT_STATES: expected an integer of 1 or more"):
        launch.env_count("PAGEDFLASH_INVARIANT_SPLIT_STATES", None)
    monkeypatch.delenv("PAGEDFLASH_INVARIANT_SPLIT_STATES")
    monkeypatch.delenv("PAGEDFLASH_INVARIANT_MAX_SPLITS")
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_DECODE_WAVES_SPLIT", "1")
    assert fresh().INVARIANT_DECODE_WAVES_SPLIT == 1
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_DECODE_WAVES_SPLIT", "0.9")  # a fraction of a wave, as fp8's
    assert fresh().INVARIANT_DECODE_WAVES_SPLIT == 0.9
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_DECODE_WAVES_SPLIT", "-1")
    with pytest.raises(ValueError, match="PAGEDFLASH_INVARIANT_DECODE_WAVES_SPLIT: expected a number of 0 or more"):
        fresh()
    monkeypatch.delenv("PAGEDFLASH_INVARIANT_DECODE_WAVES_SPLIT")
    monkeypatch.setenv("PAGEDFLASH_INVARIANT_DECODE_WAVES_FP8", "0.25")  # a fraction of a wave
    assert fresh().INVARIANT_DECODE_WAVES_FP8 == 0.25
    for bad in ("-1", "nan", "x"):
        monkeypatch.setenv("PAGEDFLASH_INVARIANT_DECODE_WAVES_FP8", bad)
        with pytest.raises(ValueError, match=f"PAGEDFLASH_INVARIANT_DECODE_WAVES_FP8: expected a number of 0 or more, "
                                             f"got '{bad}'"):
            fresh()


@pytest.mark.parametrize(("q_dtype", "kv_dtype", "converts", "rows"),
                         [(torch.bfloat16, torch.bfloat16, False, 16), (torch.bfloat16, torch.float8_e4m3fn, True, 16),
                          (torch.float16, torch.float8_e4m3fn, True, 16),
                          (torch.bfloat16, torch.float8_e4m3fn, False, 64),
                          (torch.float32, torch.float8_e4m3fn, True, 64)], ids=ids)
def test_decode_tile_admission(monkeypatch, q_dtype, kv_dtype, converts, rows):
    """The plan an sm90 GPU of 132 SMs would make for a wide decode launch in the mode: the one-warp
    decode tile for 16-bit q over 16-bit K/V, and over fp8 K/V only where the GPU converts fp8 by
    instruction (the mode's K conversion that keeps the warp's MMA in the 16-bit operand order);
    fp32 q never (CPU tensors, nothing launched)."""
    for module in (attention_plan, launch):
        monkeypatch.setattr(module, "nvidia_capability", lambda device: (9, 0))
        monkeypatch.setattr(module, "num_sms", lambda device: 132)
        monkeypatch.setattr(module, "interpreted", lambda: False)
    monkeypatch.setattr(attention_plan, "fp8_cvt_device", lambda device: converts)
    batch, hq, hkv, d, n = 64, 32, 8, 128, 1024  # 512 programs: past fp8's half wave, short of 16-bit's 8 waves
    monkeypatch.setattr(launch, "INVARIANT_DECODE_WAVES", 0)
    q = torch.empty(batch, 1, hq, d, dtype=q_dtype)
    cache = torch.empty(batch, n, hkv, d, dtype=kv_dtype)
    plan = attention_plan.make_plan(
        q, cache, cache, torch.empty_like(q, dtype=q_dtype), None, batch=batch, max_seqlen_q=1, max_seqlen_k=n,
        window=(-1, 0), softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
        seqused_k=torch.full((batch,), n, dtype=torch.int32), block_table=None, num_splits=0, config=None,
        invariant=True)
    assert (plan.cfg.block_m, plan.cfg.num_warps) == ((16, 1) if rows == 16 else (64, 4))


def test_decode_tile_admission_of_split_launches(monkeypatch):
    """PAGEDFLASH_INVARIANT_DECODE_WAVES_SPLIT: a decode launch that splits its rows' keys takes the
    one-warp tile from that many waves of sequences x KV heads (its split programs fill the SMs); an
    unsplit launch keeps INVARIANT_DECODE_WAVES. The plans an sm90 GPU of 132 SMs would make (CPU
    tensors, nothing launched); the grid counts the tile's query rows."""
    for module in (attention_plan, launch):
        monkeypatch.setattr(module, "nvidia_capability", lambda device: (9, 0))
        monkeypatch.setattr(module, "num_sms", lambda device: 132)
        monkeypatch.setattr(module, "interpreted", lambda: False)
    hq, hkv, d, page = 32, 8, 64, 16

    def plan(batch, n, width=None, num_splits=0):  # the engine's decode launch: varlen q, 16-row pages;
        width = width or n  # a graph's: a table of max_model_len keys, graph_num_splits
        q = torch.empty(batch, hq, d, dtype=torch.bfloat16)
        cache = torch.empty(batch * cdiv(width, page), page, hkv, d, dtype=torch.bfloat16)
        table = torch.arange(batch * cdiv(width, page), dtype=torch.int32).view(batch, -1)
        cu_q = torch.arange(batch + 1, dtype=torch.int32)
        return attention_plan.make_plan(
            q, cache, cache, torch.empty_like(q), None, batch=batch, max_seqlen_q=1, max_seqlen_k=width,
            window=(-1, 0), softcap=0.0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q * n, seqused_k=None, block_table=table,
            num_splits=num_splits, config=None, invariant=True)

    monkeypatch.setattr(launch, "INVARIANT_DECODE_WAVES_SPLIT", launch.INVARIANT_DECODE_WAVES)  # one threshold
    for batch, n in ((32, 1024), (64, 1024), (256, 1024), (1, 32768)):
        p = plan(batch, n)
        assert (p.cfg.block_m, p.num_splits > 1) == ((16, False) if batch == 256 else (64, True) if batch != 64
                                                     else (64, False)), (batch, n)
    monkeypatch.setattr(launch, "INVARIANT_DECODE_WAVES_SPLIT", 1)  # the default
    split = plan(32, 1024)  # 256 row-heads, split: the one-warp tile, 4 rows a program, the same splits
    assert (split.cfg.block_m, split.cfg.num_warps, split.num_splits) == (16, 1, 2)  # 1K: two 512-key head splits
    assert split.grid == (32, 8, 2)  # a program a sequence of one row
    assert plan(64, 1024).cfg.block_m == 64  # unsplit: 512 row-heads under 8 waves
    assert plan(1, 32768).cfg.block_m == 64  # split, but 8 row-heads under a wave
    for batch in (1, 16, 24, 32, 64):  # the 1B engine's decode graphs (131,072 keys) plan as their launches do
        graph = plan(batch, 32768, width=131072, num_splits=graph_num_splits(batch, hkv, 132))
        assert (graph.cfg.block_m, graph.num_splits > 1) == ((16, True) if batch in (24, 32) else
                                                             (64, batch < 64)), batch
    monkeypatch.setattr(launch, "INVARIANT_DECODE_WAVES_SPLIT", 0.9)  # batch 16's 128 row-heads from 0.97 waves
    assert plan(16, 32768, width=131072, num_splits=graph_num_splits(16, hkv, 132)).cfg.block_m == 16


def test_graph_split_bytes_follow_the_cap_and_budget(monkeypatch):
    """The engine's bound on its decode graphs' partials takes each graph's split count from the same
    rule as the launch (its rows x the rank's query heads against the budget)."""
    monkeypatch.setattr(launch, "INVARIANT_SPLIT_WAVES", 2)  # the odd-heads case below: one program a row
    heads, kv_heads, d, sms = 8, 2, 32, 16
    rule = launch.invariant_split_rule(interpreted(), d)
    model = SimpleNamespace(shard=SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads))
    spec = SimpleNamespace(batch_invariant=True, cuda_graphs=True, config=SimpleNamespace(head_dim=d),
                           max_num_seqs=64, max_model_len=rule.head_keys + (300 - rule.count(rule.head_keys)) * rule.keys)
    assert rule.count(spec.max_model_len) == 300
    split = [bs for bs in graph_sizes(64) if graph_num_splits(bs, kv_heads, sms) > 1]
    assert split == [1, 2, 4, 8]
    # 6 heads over 2 KV heads: a group of 3 divides no tile, so a program per query head, and 8 rows'
    # 48 programs leave one a row on 16 SMs: no split there
    odd = SimpleNamespace(shard=SimpleNamespace(num_heads=6, num_kv_heads=2))
    _split_switches(monkeypatch, most=512)
    sets = [(300 * (d + 1) + 1) * bs * 6 * 4 for bs in (1, 2, 4)]
    assert graph_split_bytes(odd, spec, sms) == sum(sets) + max(sets)

    def bound(graphs):
        sets = [(300 * (d + 1) + 1) * bs * heads * 4 for bs in graphs]
        return sum(sets) + max(sets, default=0)

    _split_switches(monkeypatch, most=299)
    assert graph_split_bytes(model, spec, sms) == 0  # 300 splits: past a cap of 299
    _split_switches(monkeypatch, most=512)
    assert graph_split_bytes(model, spec, sms) == bound(split)
    _split_switches(monkeypatch, most=512, states=300 * 2 * heads)  # graphs of 1 and 2 rows split
    assert graph_split_bytes(model, spec, sms) == bound([1, 2])


@pytest.mark.parametrize("loads", [1, 2, 4])
def test_combine_merges_the_rows_count_of_splits(loads):
    """The mode's combine merges as many splits as a row's count says (the LSE partials' last plane,
    which the attention kernel writes): slots past it are never read, whatever they hold; an empty
    split among the row's (lse -inf or +inf) merges as the identity, leading or not; a NaN split
    (invalid metadata) gives NaN; a row of empty splits gives 0 and -inf. ``loads``: partials loaded
    that many at a time (``PAGEDFLASH_INVARIANT_COMBINE_LOADS``), the same bits as one at a time (loads 2
    and 4: groups that end past a row's count of 3 and of 9 splits)."""
    def combine(out_part, lse_part, counts, loads=loads):
        lse_part = torch.cat([lse_part, counts.float()[None]])
        out = torch.empty(out_part.shape[1:], device=DEVICE)
        lse = torch.empty(out_part.shape[2], out_part.shape[1], device=DEVICE)
        launch_combine(plan_combine(out_part, lse_part, out, lse, tokens_per_batch=out_part.shape[1], invariant=True,
                                    loads=loads), out_part, lse_part, out, lse)
        return out, lse

    g = torch.Generator().manual_seed(0)
    splits, tokens, heads, d = 9, 4, 2, 16
    out_part = torch.randn(splits, tokens, heads, d, generator=g).to(DEVICE)
    lse_part = torch.randn(splits, tokens, heads, generator=g).to(DEVICE)
    counts = torch.full((tokens, heads), splits, device=DEVICE)
    counts[:3] = 3  # tokens 0-2: 3 splits; their slots past them hold NaN, never read
    lse_part[3:, :3] = float("nan")
    out_part[3:, :3] = float("nan")
    lse_part[0, 1] = float("-inf")  # token 1: a leading empty split
    lse_part[1, 2] = float("inf")  # token 2: an empty split inside
    lse_part[6, 3] = float("nan")  # token 3: every split, one of them NaN
    lse_part[:3, 0, 1] = float("-inf")  # token 0, head 1: nothing
    out, lse = combine(out_part, lse_part, counts)
    one_out, one_lse = combine(out_part, lse_part, counts, loads=1)
    assert torch.equal(out.view(torch.int32), one_out.view(torch.int32))  # (bits: NaN rows and signed zeros too)
    assert torch.equal(lse.view(torch.int32), one_lse.view(torch.int32))
    own_out, own_lse = combine(out_part[:3, :3].contiguous(), lse_part[:3, :3].contiguous(), counts[:3])
    assert torch.equal(out[:3], own_out) and torch.equal(lse[:, :3], own_lse)
    assert torch.isfinite(out[:3]).all()
    kept = [0, 2]  # token 2 without its empty split: the same bits
    alone_out, alone_lse = combine(out_part[kept, 2:3].contiguous(), lse_part[kept, 2:3].contiguous(),
                                   torch.full((1, heads), 2, device=DEVICE))
    assert torch.equal(out[2:3], alone_out) and torch.equal(lse[:, 2:3], alone_lse)
    assert torch.isnan(out[3]).all() and torch.isnan(lse[:, 3]).all()
    assert torch.equal(out[0, 1], torch.zeros(d, device=DEVICE)) and lse[1, 0] == float("-inf")
    unwritten = torch.full((tokens, heads), float("nan"), device=DEVICE)  # no count: NaN rows, not zeros
    assert all(torch.isnan(t).all() for t in combine(out_part, lse_part, unwritten))
    assert all(torch.isnan(t).all() for t in combine(out_part, lse_part, torch.zeros(tokens, heads, device=DEVICE)))
    # a state of -0.0 (a negative value weighted to 0 by a far larger lse, then a -0.0 partial) keeps its
    # sign through the slots past the row's count, as when they are never visited
    # (loads 2: the second group holds the third split and a slot past the count)
    sign_out = torch.tensor([[-1.0], [-0.0], [-0.0], [5.0]], device=DEVICE).expand(4, d)[:, None, None].contiguous()
    sign_lse = torch.tensor([0.0, 200.0, 200.0, 1.0], device=DEVICE)[:, None, None].contiguous()
    three = torch.full((1, 1), 3, device=DEVICE)
    signed, _ = combine(sign_out, sign_lse, three)
    assert torch.signbit(signed).all() and (signed == 0).all()


def test_combine_loads_switch_reaches_the_launch(monkeypatch):
    """``PAGEDFLASH_INVARIANT_COMBINE_LOADS`` (launch.INVARIANT_COMBINE_LOADS) plans the mode's combine
    with that many loads at a time (a switch of the plans' keys), with the bits of one at a time."""
    hq, hkv, d, dtype = 4, 2, 32, DTYPES[-1]
    rule = launch.invariant_split_rule(interpreted(), d)
    lens = [rule.head_keys + 3 * rule.keys + 5, 40]
    k_cache, v_cache, table = make_pool(lens, PAGE, hkv, d, dtype)
    q = randn(2, hq, d, dtype=dtype)
    got = {}
    attention.clear_plans()
    for loads in (1, 3):  # the second call's own plan (the switch is part of the key), beside the first's
        monkeypatch.setattr(launch, "INVARIANT_COMBINE_LOADS", loads)
        got[loads] = _varlen(q, (k_cache, v_cache), table, [1, 1], lens, {}, num_splits=2)
    plans = [p for p in attention._PLANS.values() if p.consts["INVARIANT"] and p.combine is not None]
    assert sorted(p.combine.consts["LOADS"] for p in plans) == [1, 3]
    assert all(torch.equal(a, b) for a, b in zip(got[1], got[3]))


def test_rows_past_max_seqlen_k_are_nan_in_a_split_launch():
    """A split launch's partial slots are sized by max_seqlen_k: a row whose keys reach past it (an
    understated bound) gives NaN and a fault naming cu_seqlens_k, never a row with its last splits
    dropped; the rows within the bound keep their bits."""
    hq, hkv, d, dtype = 4, 2, 32, DTYPES[-1]
    rule = launch.invariant_split_rule(interpreted(), d)
    short, long = rule.head_keys + 2 * rule.keys, rule.head_keys + 6 * rule.keys
    k_cache, v_cache, table = make_pool([short, long], PAGE, hkv, d, dtype)
    caches = (k_cache, v_cache)
    q = randn(2, hq, d, dtype=dtype)
    validate.invalid_metadata()  # (clears earlier records)
    alone, alone_lse = _varlen(q[:1], caches, table[:1], [1], [short], {}, num_splits=2)
    attention.clear_plans()
    with validate.value_checks(False):  # (the debug mode refuses the bound on the host)
        out, lse = _varlen(q, caches, table, [1, 1], [short, long], {}, num_splits=2, max_seqlen_k=short)
    assert {plan.num_splits for plan in attention._PLANS.values()} == {rule.count(short)}  # a split launch
    assert torch.equal(out[0], alone[0]) and torch.equal(lse[:, 0], alone_lse[:, 0])
    assert bool(out[1].isnan().all()) and bool(lse[:, 1].isnan().all())
    with pytest.raises(ValueError, match=r"cu_seqlens_k: .*at most max_seqlen_k.* found sequence 1 invalid"):
        validate.raise_if_invalid()


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=ids)
def test_a_score_scale_that_underflows_gives_no_nan(dtype):
    """softmax_scale x k_descale below fp32's range (1e-17 x 1e-30) makes the kernels' score scale 0:
    every visible key then weighs the same, in the mode (whose masked scores are scaled after the
    mask: -inf x 0 would be NaN) and out of it (D = 64: on sm90 the Gluon prefill, which masks before
    it scales too), and the two agree."""
    lens = [LEN]
    k_cache, v_cache, table = fp8_pool(lens, PAGE, 2, 64)
    q = randn(LEN, 4, 64, dtype=dtype)
    opts = dict(k_descale=torch.full((2,), 1e-30, device=DEVICE), v_descale=torch.full((2,), 0.75, device=DEVICE),
                softmax_scale=1e-17)
    got = {}
    for invariant in (True, False):
        got[invariant] = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens(lens), cu_seqlens(lens), LEN, LEN,
                                                causal=True, block_table=table, return_lse=True,
                                                batch_invariant=invariant, **opts)
        out, lse = got[invariant]
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"batch_invariant={invariant}"
    assert_close(got[True][0].float(), got[False][0].float(), dtype, "out")
    assert_close(got[True][1], got[False][1], torch.float32, "lse")

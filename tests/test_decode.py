"""Split-KV decode over a contiguous cache, and the LSE merge."""

import pytest
import torch
from helpers import DTYPES, ON_GPU, assert_close, cu_seqlens, ids, make_pool, randn

from pagedflash import flash_attn_varlen_func, flash_attn_with_kvcache, merge_attn_states
from pagedflash import reference as ref
from pagedflash.ops import attention
from pagedflash.testing import capture_graph

SPLITS = [1, 3, 8, 40, 0]  # 40: more splits than KV tiles (empty splits) and a multi-chunk combine
HEADS = [(8, 8), (8, 2), (5, 1), (32, 4)] if ON_GPU else [(4, 4), (8, 2), (5, 1)]


def _lse_tol(dtype):
    return torch.float32 if dtype == torch.float32 else torch.float16


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("num_splits", SPLITS)
@pytest.mark.parametrize("hq,hkv", HEADS, ids=str)
@pytest.mark.parametrize("sq", [1, 4])
def test_decode_contiguous(dtype, num_splits, hq, hkv, sq):
    b, s_max, d = 3, 200 if ON_GPU else 70, 64
    q = randn(b, sq, hq, d, dtype=dtype)
    k_cache, v_cache = randn(b, s_max, hkv, d, dtype=dtype), randn(b, s_max, hkv, d, dtype=dtype)
    seqlens = torch.tensor([s_max, 33, 5], dtype=torch.int32, device=q.device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits,
                                       return_lse=True)
    ref_out, ref_lse = ref.kvcache_attention_ref(q, k_cache, v_cache, seqlens)
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, _lse_tol(dtype), name="lse")


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("s_new", [1, 3, 16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_append_new_tokens(dtype, s_new, num_splits):
    b, s_max, hq, hkv, d = 2, 64, 8, 2, 80
    q = randn(b, s_new, hq, d, dtype=dtype)
    k_cache, v_cache = randn(b, s_max, hkv, d, dtype=dtype), randn(b, s_max, hkv, d, dtype=dtype)
    k_new, v_new = randn(b, s_new, hkv, d, dtype=dtype), randn(b, s_new, hkv, d, dtype=dtype)
    seqlens = torch.tensor([0, 40], dtype=torch.int32, device=q.device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                  num_splits=num_splits)
    ref.append_ref(k_ref, v_ref, k_new, v_new, seqlens)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "new tokens not written in place"
    ref_out, _ = ref.kvcache_attention_ref(q, k_ref, v_ref, seqlens + s_new)
    assert_close(out, ref_out, dtype)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_empty_rows_give_zero_and_neg_inf(num_splits):
    q = randn(3, 1, 4, 32)
    k_cache, v_cache = randn(3, 50, 2, 32), randn(3, 50, 2, 32)
    seqlens = torch.tensor([0, 17, 0], dtype=torch.int32, device=q.device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=num_splits,
                                       return_lse=True)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[2]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[1]).all()


def test_loads_are_bounded_by_the_length():
    # cache slots past each row's length hold NaN: a load that relies on the score mask shows it
    q = randn(2, 1, 4, 64)
    k_cache, v_cache = randn(2, 77, 4, 64), randn(2, 77, 4, 64)
    seqlens = torch.tensor([31, 50], dtype=torch.int32, device=q.device)
    for b, n in enumerate(seqlens.tolist()):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    for splits in (1, 4):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=splits)
        assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, seqlens)[0], torch.float32)


@pytest.mark.parametrize("opts", [dict(window_size=(9, 0)), dict(softcap=5.0), dict(causal=False)], ids=str)
def test_window_softcap_noncausal(opts):
    q = randn(2, 3, 4, 32)
    k_cache, v_cache = randn(2, 60, 2, 32), randn(2, 60, 2, 32)
    seqlens = torch.tensor([60, 21], dtype=torch.int32, device=q.device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=3, **opts)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, seqlens, **opts)[0], torch.float32)


def test_int_and_none_cache_seqlens():
    q = randn(2, 1, 4, 32)
    k_cache, v_cache = randn(2, 40, 4, 32), randn(2, 40, 4, 32)
    full = torch.tensor([40, 40], dtype=torch.int32, device=q.device)
    want = ref.kvcache_attention_ref(q, k_cache, v_cache, full)[0]
    assert_close(flash_attn_with_kvcache(q, k_cache, v_cache), want, torch.float32)
    assert_close(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=40), want, torch.float32)


def test_deterministic_across_runs():
    q = randn(2, 1, 8, 64, dtype=DTYPES[-1])
    k_cache, v_cache = randn(2, 300, 2, 64, dtype=q.dtype), randn(2, 300, 2, 64, dtype=q.dtype)
    seqlens = torch.tensor([300, 123], dtype=torch.int32, device=q.device)
    first = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=6, return_lse=True)
    for _ in range(3):
        again = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, num_splits=6, return_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("g_pack", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_part_of_a_gqa_group_per_program(g_pack, num_splits):
    """A forced tile that packs only part of a KV head's query heads (`bench tune --tiles ...:gN`)
    computes every head; one whose g_pack does not divide the group is refused before launch."""
    from pagedflash.ops.attention import attention_forward
    from pagedflash.ops.launch import LaunchConfig

    b, n, hq, hkv, d = 2, 90, 8, 2, 32
    q = randn(b, 1, hq, d, dtype=DTYPES[-1])
    k_cache, v_cache = randn(b, n, hkv, d, dtype=q.dtype), randn(b, n, hkv, d, dtype=q.dtype)
    seqlens = torch.tensor([n, 41], dtype=torch.int32, device=q.device)
    call = dict(batch=b, max_seqlen_q=1, max_seqlen_k=n, sm_scale=d**-0.5, window=(-1, 0), softcap=0.0,
                seqused_k=seqlens, num_splits=num_splits)
    cfg = LaunchConfig(block_m=16, block_n=16, g_pack=g_pack)
    out, _ = attention_forward(q, k_cache, v_cache, config=cfg, **call)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, seqlens)[0], q.dtype)
    for bad in (3, 8):
        with pytest.raises(ValueError, match="config.g_pack: expected a divisor of the GQA group"):
            attention_forward(q, k_cache, v_cache, config=LaunchConfig(block_m=16, block_n=16, g_pack=bad), **call)


@pytest.mark.skipif(not ON_GPU, reason="long contexts are for the compiled GPU run")
@pytest.mark.parametrize("n", [16384, 131072])
def test_long_context_bf16(n):
    q = randn(1, 1, 32, 128, dtype=torch.bfloat16)
    k_cache, v_cache = randn(1, n, 8, 128, dtype=torch.bfloat16), randn(1, n, 8, 128, dtype=torch.bfloat16)
    seqlens = torch.tensor([n - 3], dtype=torch.int32, device=q.device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, seqlens)[0], torch.bfloat16)


@pytest.mark.skipif(not ON_GPU, reason="long contexts are for the compiled GPU run")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=ids)
@pytest.mark.parametrize("b,hkv,n", [(40, 4, 4100), (16, 8, 5000)], ids=["wide", "one_split_per_sm"])
def test_long_decode_tiles(dtype, b, hkv, n):
    # 4K+ keys per program: 128-key tiles for 16-bit caches (two deep in a grid wider than the GPU,
    # three deep alone on an SM); fp32 keeps the shorter tiles (32 x 4 wide, 64 x 3 alone), whose
    # stages fit shared memory. Ragged lengths, NaN in every slot past them.
    q = randn(b, 1, 4 * hkv, 128, dtype=dtype)
    k_cache, v_cache = randn(b, n, hkv, 128, dtype=dtype), randn(b, n, hkv, 128, dtype=dtype)
    seqlens = torch.randint(max(n - 200, 1), n + 1, (b,), dtype=torch.int32, device=q.device)
    seqlens[0] = 1
    for row, length in enumerate(seqlens.tolist()):
        k_cache[row, length:] = float("nan")
        v_cache[row, length:] = float("nan")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache, v_cache, seqlens)[0], dtype)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_replay_with_changing_lengths(paged):
    b, s_max, hq, hkv, d, page = 4, 1024, 16, 4, 128, 16
    dtype = torch.bfloat16
    q = randn(b, 1, hq, d, dtype=dtype)
    if paged:
        pool = b * s_max // page * 2
        k_cache, v_cache = randn(pool, page, hkv, d, dtype=dtype), randn(pool, page, hkv, d, dtype=dtype)
        block_table = torch.randperm(pool, device=q.device)[: b * s_max // page].view(b, -1).int()
    else:
        k_cache, v_cache = randn(b, s_max, hkv, d, dtype=dtype), randn(b, s_max, hkv, d, dtype=dtype)
        block_table = None
    k_new, v_new = randn(b, 1, hkv, d, dtype=dtype), randn(b, 1, hkv, d, dtype=dtype)
    seqlens = torch.tensor([10, 100, 500, 1000], dtype=torch.int32, device=q.device)

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                       block_table=block_table, num_splits=8)

    graph, out = capture_graph(step)
    for lengths in ([1, 2, 3, 4], [1023, 0, 511, 64], [200, 300, 400, 1000]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(randn(b, 1, hq, d, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.kvcache_attention_ref(q, k_cache, v_cache, seqlens + 1, block_table=block_table)[0]
        assert_close(out, want, dtype)


def test_merge_attn_states_matches_reference_and_handles_inf():
    out_a, out_b = randn(3, 5, 4, 48), randn(3, 5, 4, 48)
    lse_a, lse_b = randn(3, 5, 4) * 4, randn(3, 5, 4) * 4
    lse_a[0, 0, 0] = lse_b[0, 0, 0] = float("-inf")
    lse_a[1, 1, 1] = float("inf")
    lse_b[2, 2, 2] = float("-inf")
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = ref.merge_attn_states_ref(out_a, lse_a, out_b, lse_b)
    assert not out.isnan().any() and not lse.isnan().any()
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32, name="lse")
    assert torch.equal(out[0, 0, 0], torch.zeros_like(out[0, 0, 0])) and torch.isneginf(lse[0, 0, 0])


def test_merge_of_two_halves_equals_attention_over_all():
    q = randn(2, 1, 4, 32)
    k_cache, v_cache = randn(2, 60, 4, 32), randn(2, 60, 4, 32)
    full = flash_attn_with_kvcache(q, k_cache, v_cache, return_lse=True)
    a = flash_attn_with_kvcache(q, k_cache[:, :25].contiguous(), v_cache[:, :25].contiguous(), causal=False,
                                return_lse=True)
    b = flash_attn_with_kvcache(q, k_cache[:, 25:].contiguous(), v_cache[:, 25:].contiguous(), causal=False,
                                return_lse=True)
    out, lse = merge_attn_states(a[0][:, 0], a[1][..., 0], b[0][:, 0], b[1][..., 0])
    assert_close(out, full[0][:, 0], torch.float32)
    assert_close(lse, full[1][..., 0], torch.float32, name="lse")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlens", ["tensor", "int"])
def test_empty_batch_gives_empty_outputs(paged, seqlens):
    q, k, v = randn(0, 1, 4, 32), randn(0, 1, 2, 32), randn(0, 1, 2, 32)
    k_cache, v_cache = (randn(3, 4, 2, 32), randn(3, 4, 2, 32)) if paged else (randn(0, 8, 2, 32), randn(0, 8, 2, 32))
    table = torch.zeros(0, 2, dtype=torch.int32, device=q.device) if paged else None
    lens = torch.zeros(0, dtype=torch.int32, device=q.device) if seqlens == "tensor" else 3
    before = k_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, block_table=table,
                                       return_lse=True)
    assert out.shape == (0, 1, 4, 32) and lse.shape == (0, 4, 1) and lse.dtype == torch.float32
    assert torch.equal(k_cache, before)


def test_no_query_rows_still_append_the_new_tokens():
    q = randn(2, 0, 4, 32)
    k_cache, v_cache = randn(2, 8, 2, 32), randn(2, 8, 2, 32)
    k, v = randn(2, 1, 2, 32), randn(2, 1, 2, 32)
    lens = torch.tensor([1, 6], dtype=torch.int32, device=q.device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens)
    assert out.shape == (2, 0, 4, 32)
    assert torch.equal(k_cache[0, 1], k[0, 0]) and torch.equal(v_cache[1, 6], v[1, 0])


def test_zero_query_heads_are_refused_by_name():
    q, k_cache = randn(1, 1, 0, 32), randn(1, 8, 2, 32)
    with pytest.raises(ValueError, match="heads: .*got Hq=0, Hkv=2"):
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=3)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_one_query_row_has_no_right_edge_to_mask(batch_invariant):
    """A sequence of one query row sees every key below its length under any right window (bottom-right
    aligned): causal, a right window and none give the same bits, and the launch masks no right edge;
    with two rows it does. Either launch runs one program a sequence (one query tile each)."""
    hq, hkv, d, page, lens = 4, 2, 32, 16, [70, 3, 41]
    dtype = DTYPES[-1]
    k_cache, v_cache, table = make_pool(lens, page, hkv, d, dtype)
    q = randn(len(lens) + 1, hq, d, dtype=dtype)

    def run(lens_q, **opts):
        attention.clear_plans()
        out = flash_attn_varlen_func(q[:sum(lens_q)], k_cache, v_cache, cu_seqlens(lens_q), cu_seqlens(lens),
                                     max(lens_q), max(lens), block_table=table, num_splits=2,
                                     batch_invariant=batch_invariant, **opts)
        (plan,) = attention._PLANS.values()
        assert plan.grid[0] == len(lens)  # a program a sequence: none has more rows than a tile
        return out, plan.consts["HAS_RIGHT"]

    ones = [1] * len(lens)
    full, masked = run(ones)
    assert not masked
    for opts in (dict(causal=True), dict(window_size=(-1, 3))):
        out, masked = run(ones, **opts)
        assert not masked and torch.equal(out, full), opts
    sliding = run(ones, window_size=(5, -1))[0]  # a left edge stays
    for right in (0, 3):
        out, masked = run(ones, window_size=(5, right))
        assert not masked and torch.equal(out, sliding), right
    assert run([2, 1, 1], causal=True)[1]

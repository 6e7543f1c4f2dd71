"""Prototype (experiment, not the library's path), prepared for the next device session: chunked
prefill over 16-row pages with one TMA box per page and four pages per softmax step.

v15 measured the library's paged prefill over 16-row pages at 0.64-0.70x of dense (pointer tiles
gathering rows through the block table) and 16-key TMA tiles at 0.35-0.41x (the softmax and the
accumulator rescale once per 16 keys). Here a 64-key step loads four 16-row boxes (one per page)
through a descriptor over the pool, computes four 16-key score blocks, and folds them into the
softmax state once: one max, one rescale, four P.V dots into the same accumulator.
*Prediction*: >= 0.85x of dense at B=1, 512 new tokens over 16K cached (the page-64 TMA path
reaches 0.99x). Causal, bottom-right aligned, varlen q, GQA; Hopper descriptors only.
    TRITON_INTERPRET=1 python tools/paged_subtile_proto.py check     (CPU: correctness)
    python tools/paged_subtile_proto.py [cached ...]                  (GPU: time vs the library)"""
import os
import sys
from functools import partial

import torch
import triton
import triton.language as tl

from pagedflash.ops._jit import LOG2E, NEG_INF


@triton.jit
def _page_ids(Table, row, p0, n_pages):
    """Block-table entries of pages p0 .. p0 + 3 of a sequence (0 past its last page: never used)."""
    b0 = tl.load(Table + row + p0, mask=p0 < n_pages, other=0)
    b1 = tl.load(Table + row + p0 + 1, mask=p0 + 1 < n_pages, other=0)
    b2 = tl.load(Table + row + p0 + 2, mask=p0 + 2 < n_pages, other=0)
    b3 = tl.load(Table + row + p0 + 3, mask=p0 + 3 < n_pages, other=0)
    return b0, b1, b2, b3


@triton.jit
def _scores(q, k_desc, blk, pos, q_pos, delta, seqlen_k, qk_scale, PAGE: tl.constexpr, MASKED: tl.constexpr):
    k = k_desc.load([blk * PAGE, 0])  # [PAGE, D]: one page
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        ok = (pos[None, :] <= q_pos[:, None] + delta) & (pos[None, :] < seqlen_k)
        s = tl.where(ok, s, NEG_INF)
    return s


@triton.jit
def _values(v_desc, blk, pos, seqlen_k, PAGE: tl.constexpr, MASKED: tl.constexpr):
    v = v_desc.load([blk * PAGE, 0])
    if MASKED:  # slots of the last page past the sequence may hold anything (0 * NaN = NaN)
        v = tl.where((pos < seqlen_k)[:, None], v, 0.0)
    return v


@triton.jit
def _step(acc, l_i, m_i, q, k_desc, v_desc, blks, start, q_pos, delta, seqlen_k, qk_scale,
          PAGE: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, PAGE)
    b0, b1, b2, b3 = blks
    s0 = _scores(q, k_desc, b0, start + offs, q_pos, delta, seqlen_k, qk_scale, PAGE, MASKED)
    s1 = _scores(q, k_desc, b1, start + PAGE + offs, q_pos, delta, seqlen_k, qk_scale, PAGE, MASKED)
    s2 = _scores(q, k_desc, b2, start + 2 * PAGE + offs, q_pos, delta, seqlen_k, qk_scale, PAGE, MASKED)
    s3 = _scores(q, k_desc, b3, start + 3 * PAGE + offs, q_pos, delta, seqlen_k, qk_scale, PAGE, MASKED)
    m_new = tl.maximum(tl.maximum(tl.maximum(m_i, tl.max(s0, 1)), tl.maximum(tl.max(s1, 1), tl.max(s2, 1))),
                       tl.max(s3, 1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    p0 = tl.exp2(s0 - m_safe[:, None])
    p1 = tl.exp2(s1 - m_safe[:, None])
    p2 = tl.exp2(s2 - m_safe[:, None])
    p3 = tl.exp2(s3 - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p0, 1) + tl.sum(p1, 1) + tl.sum(p2, 1) + tl.sum(p3, 1)
    acc = acc * alpha[:, None]
    v0 = _values(v_desc, b0, start + offs, seqlen_k, PAGE, MASKED)
    acc = tl.dot(p0.to(v0.dtype), v0, acc)
    v1 = _values(v_desc, b1, start + PAGE + offs, seqlen_k, PAGE, MASKED)
    acc = tl.dot(p1.to(v1.dtype), v1, acc)
    v2 = _values(v_desc, b2, start + 2 * PAGE + offs, seqlen_k, PAGE, MASKED)
    acc = tl.dot(p2.to(v2.dtype), v2, acc)
    v3 = _values(v_desc, b3, start + 3 * PAGE + offs, seqlen_k, PAGE, MASKED)
    acc = tl.dot(p3.to(v3.dtype), v3, acc)
    return acc, l_i, m_new


@triton.jit
def _range(acc, l_i, m_i, q, k_desc, v_desc, Table, row, n_pages, lo, hi, q_pos, delta, seqlen_k, qk_scale,
           PAGE: tl.constexpr, MASKED: tl.constexpr):
    blks_next = _page_ids(Table, row, lo // PAGE, n_pages)
    for start in range(lo, hi, 4 * PAGE):
        blks = blks_next  # this step's pages were read one step ahead
        blks_next = _page_ids(Table, row, (start + 4 * PAGE) // PAGE, n_pages)
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k_desc, v_desc, blks, start, q_pos, delta, seqlen_k, qk_scale,
                              PAGE, MASKED)
    return acc, l_i, m_i


@triton.jit
def _subtile_kernel(Q, KPool, VPool, Out, Table, CuQ, CuK,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    stride_tb, pool_rows, sm_scale,
                    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CuQ + b)
    seqlen_q = tl.load(CuQ + b + 1) - q_start
    seqlen_k = tl.load(CuK + b + 1) - tl.load(CuK + b)
    q0 = pid_m * BLOCK_M
    if q0 >= seqlen_q:
        return
    delta = seqlen_k - seqlen_q
    kvh = h // GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q_pos = q0 + offs_m
    m_ok = q_pos < seqlen_q
    q_rows = (q_start + q_pos).to(tl.int64) * stride_qt + h * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    k_desc = tl.make_tensor_descriptor(KPool + kvh * stride_kh, shape=[pool_rows, D], strides=[stride_kt, 1],
                                       block_shape=[PAGE, D])
    v_desc = tl.make_tensor_descriptor(VPool + kvh * stride_vh, shape=[pool_rows, D], strides=[stride_vt, 1],
                                       block_shape=[PAGE, D])
    STEP: tl.constexpr = 4 * PAGE
    hi = tl.minimum(q0 + BLOCK_M + delta, seqlen_k)  # keys any row of this tile sees (causal)
    full_hi = tl.maximum(tl.minimum((q0 + delta + 1) // STEP * STEP, hi), 0)  # keys every row sees, whole steps
    n_pages = tl.cdiv(seqlen_k, PAGE)
    row = b.to(tl.int64) * stride_tb
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    acc, l_i, m_i = _range(acc, l_i, m_i, q, k_desc, v_desc, Table, row, n_pages, 0, full_hi, q_pos, delta, seqlen_k,
                           qk_scale, PAGE, False)
    acc, l_i, m_i = _range(acc, l_i, m_i, q, k_desc, v_desc, Table, row, n_pages, full_hi, hi, q_pos, delta,
                           seqlen_k, qk_scale, PAGE, True)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + q_pos).to(tl.int64) * stride_ot + h * stride_oh
    tl.store(Out + o_rows[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty), mask=m_ok[:, None])


def subtile_prefill(q, k_pool, v_pool, cu_q, cu_k, max_q, table, *, block_m=64, warps=4, stages=3):
    from pagedflash.ops.attention import _ensure_allocator

    _ensure_allocator()
    total, hq, d = q.shape
    page, hkv = k_pool.shape[1], k_pool.shape[2]
    assert page == 16 and k_pool.stride(0) == page * k_pool.stride(1)
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_q, block_m), hq, cu_q.shape[0] - 1)
    _subtile_kernel[grid](q, k_pool, v_pool, out, table, cu_q, cu_k, q.stride(0), q.stride(1),
                          k_pool.stride(1), k_pool.stride(2), v_pool.stride(1), v_pool.stride(2),
                          out.stride(0), out.stride(1), table.stride(0), k_pool.shape[0] * page, d**-0.5,
                          GROUP=hq // hkv, D=d, BLOCK_M=block_m, PAGE=page, num_warps=warps, num_stages=stages)
    return out


def _pool(k, v, lens, page, dtype, device):
    """Pages of the sequences' K/V in a random order, NaN in every unused slot."""
    from pagedflash.bench.decode import permuted_table

    pages = [-(-n // page) for n in lens]
    table = permuted_table(sum(pages) + 3, len(lens))[:, : max(pages)].contiguous()
    num_blocks = int(table.max()) + 4
    hkv, d = k.shape[1], k.shape[2]
    pools = [torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype, device=device) for _ in range(2)]
    start = 0
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=device)
        blk, off = table[b, pos // page].long(), pos % page
        pools[0][blk, off] = k[start: start + n]
        pools[1][blk, off] = v[start: start + n]
        start += n
    return pools[0], pools[1], table


def check() -> None:
    import pagedflash.ops.launch as launch
    from pagedflash import flash_attn_varlen_func

    launch.INTERPRET_TMA = True
    torch.manual_seed(0)
    device, dtype = "cpu", torch.float16
    new, cached = [5, 40], [100, 23]
    lens = [a + c for a, c in zip(new, cached)]
    q = torch.randn(sum(new), 4, 32, dtype=dtype)
    k, v = torch.randn(sum(lens), 2, 32, dtype=dtype), torch.randn(sum(lens), 2, 32, dtype=dtype)
    k_pool, v_pool, table = _pool(k, v, lens, 16, dtype, device)
    cu_q = torch.tensor([0, new[0], sum(new)], dtype=torch.int32)
    cu_k = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    want = flash_attn_varlen_func(q.float(), k.float(), v.float(), cu_q, cu_k, max(new), max(lens), causal=True)
    got = subtile_prefill(q, k_pool, v_pool, cu_q, cu_k, max(new), table, block_m=16)
    err = (got.float() - want).abs().max().item()
    print(f"max |subtile - library dense fp32| = {err:.3g}")
    assert err < 5e-3, err


def bench(cached_list) -> None:
    # the v15 probe's case (tools/ is on sys.path when this runs as a script)
    from paged_prefill_probe import NEW, chunked_case

    from pagedflash import flash_attn_varlen_func, validate
    from pagedflash.bench.tune import _time_us

    validate.value_checks(False).__enter__()
    for cached in cached_list:
        q, k, v, n, _, dense, want, cu_q, cu_k = chunked_case(cached)
        k_pool, v_pool, table = _pool(k[0], v[0], [n], 16, torch.bfloat16, "cuda")
        lib = _time_us(partial(flash_attn_varlen_func, q[0], k_pool, v_pool, cu_q, cu_k, NEW, n, causal=True,
                               block_table=table))
        print(f"  library page 16: {lib:.1f} us (x{dense / lib:.2f} dense)", flush=True)
        for bm, w, st in [(64, 4, 3), (64, 4, 2), (128, 8, 3), (128, 8, 2), (128, 4, 3), (64, 4, 4)]:
            call = partial(subtile_prefill, q[0], k_pool, v_pool, cu_q, cu_k, NEW, table, block_m=bm, warps=w,
                           stages=st)
            try:
                err = (call().float() - want).abs().max().item()
                us = _time_us(call)
                print(f"  subtile bm={bm} w={w} s={st}: {us:7.1f} us  x{dense / us:.2f} dense  err {err:.2g}",
                      flush=True)
            except Exception as e:  # noqa: BLE001  (ptxas may refuse a tile: report and go on)
                print(f"  subtile bm={bm} w={w} s={st}: {type(e).__name__}: {str(e)[:100]}")


if __name__ == "__main__":
    if sys.argv[1:] == ["check"] or os.environ.get("TRITON_INTERPRET") == "1":
        check()
    else:
        bench([int(x) for x in sys.argv[1:]] or [16384, 4096])

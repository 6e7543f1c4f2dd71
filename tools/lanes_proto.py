"""Prototype (experiment, not the library's path): decode with the key tile split into LANES
independent softmax streams, one per batch slice of a 3-D dot, merged once at the end of the program.
cuDNN's decode kernel (profile: "16x128x128_1x4x1") puts its 4 warps along the keys; Triton's
2-D dot with 16 rows spreads warps over the key/feature columns, so each tile pays cross-warp max/sum
reductions and a shared-memory round trip of P. With a batch dimension the warps take one lane each.
    python tools/lanes_proto.py            (GPU: timing against the library and cuDNN)
    TRITON_INTERPRET=1 python tools/lanes_proto.py check   (CPU: correctness only)"""
import os
import sys
from functools import partial

import torch
import triton
import triton.language as tl

from pagedflash.ops._jit import LOG2E, NEG_INF


@triton.jit
def _lanes_range(acc, l_i, m_i, q, K, V, start_lo, start_hi, hi, rel, offs_d, stride_kt, stride_vt, qk_scale,
                 TILE: tl.constexpr, MASKED: tl.constexpr):
    """Fold the tiles starting in [start_lo, start_hi) into each lane's softmax state; a tile's lanes
    are its key offsets ``rel`` ``[LANES, BLOCK_N]`` (TILE = LANES x BLOCK_N keys), keys at or past
    ``hi`` masked when MASKED."""
    for start in range(start_lo, start_hi, TILE):
        pos = start + rel
        n_ok = pos < hi
        off = pos.to(tl.int64)[:, :, None] * stride_kt + offs_d[None, None, :]
        if MASKED:
            k = tl.load(K + off, mask=n_ok[:, :, None], other=0.0)
        else:
            k = tl.load(K + off)
        s = tl.dot(q, tl.trans(k, (0, 2, 1))) * qk_scale  # [LANES, BLOCK_M, BLOCK_N]
        if MASKED:
            s = tl.where(n_ok[:, None, :], s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 2))
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        p = tl.exp2(s - m_safe[:, :, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 2)
        acc = acc * alpha[:, :, None]
        voff = pos.to(tl.int64)[:, :, None] * stride_vt + offs_d[None, None, :]
        if MASKED:
            v = tl.load(V + voff, mask=n_ok[:, :, None], other=0.0)
        else:
            v = tl.load(V + voff)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _lanes_kernel(Q, K, V, Out, Lens, OutPart, LsePart,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_ob, stride_oh, stride_ps, stride_pt, stride_ph, stride_lps, stride_lpt,
                  num_splits, sm_scale,
                  GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  LANES: tl.constexpr, SPLIT: tl.constexpr, MASK_ALL: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(Lens + b)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    lane = tl.arange(0, LANES)
    head = kvh * GROUP + offs_m
    m_ok = offs_m < GROUP
    q = tl.load(Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=m_ok[:, None],
                other=0.0)
    q = tl.broadcast_to(q[None, :, :], [LANES, BLOCK_M, D])
    TILE: tl.constexpr = LANES * BLOCK_N
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(seqlen, TILE), num_splits) * TILE
        lo = split * per_split
        hi = tl.minimum(lo + per_split, seqlen)
    else:
        lo = 0
        hi = seqlen
    full_hi = tl.maximum(lo, lo + ((hi - lo) // TILE) * TILE)
    K += b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([LANES, BLOCK_M], NEG_INF, dtype=tl.float32)
    l_i = tl.zeros([LANES, BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([LANES, BLOCK_M, D], dtype=tl.float32)
    rel = lane[:, None] * BLOCK_N + offs_n[None, :]  # [LANES, BLOCK_N]: key offsets in a tile
    # unmasked whole tiles, then one masked tail tile (MASK_ALL: every tile masked, one loop)
    acc, l_i, m_i = _lanes_range(acc, l_i, m_i, q, K, V, lo, hi if MASK_ALL else full_hi, hi, rel, offs_d,
                                 stride_kt, stride_vt, qk_scale, TILE, MASK_ALL)
    if not MASK_ALL:
        acc, l_i, m_i = _lanes_range(acc, l_i, m_i, q, K, V, full_hi, hi, hi, rel, offs_d, stride_kt, stride_vt,
                                     qk_scale, TILE, True)
    # merge the lanes
    m = tl.max(m_i, 0)
    m_safe = tl.where(m == NEG_INF, 0.0, m)
    w = tl.exp2(m_i - m_safe[None, :])  # [LANES, BLOCK_M]
    l_tot = tl.sum(l_i * w, 0)
    o = tl.sum(acc * w[:, :, None], 0)
    empty = l_tot == 0.0
    o = o / tl.where(empty, 1.0, l_tot)[:, None]
    lse = tl.where(empty, NEG_INF, (m_safe + tl.log2(tl.where(empty, 1.0, l_tot))) * 0.6931471805599453)
    if SPLIT:
        rows = split * stride_ps + b.to(tl.int64) * stride_pt + head * stride_ph
        tl.store(OutPart + rows[:, None] + offs_d[None, :], o, mask=m_ok[:, None])
        tl.store(LsePart + split * stride_lps + b.to(tl.int64) * stride_lpt + head, lse, mask=m_ok)
    else:
        rows = b.to(tl.int64) * stride_ob + head * stride_oh
        tl.store(Out + rows[:, None] + offs_d[None, :], o.to(Out.dtype.element_ty), mask=m_ok[:, None])


def lanes_decode(q, kc, vc, lens, *, lanes=4, block_n=32, splits=1, warps=4, stages=3, mask_all=False):
    from pagedflash.ops.combine import combine_splits

    b, _, hq, d = q.shape
    hkv = kc.shape[2]
    out = torch.empty_like(q)
    if splits > 1:
        part = torch.empty((splits, b, hq, d), dtype=torch.float32, device=q.device)
        lpart = torch.empty((splits, b, hq), dtype=torch.float32, device=q.device)
    else:
        part = lpart = out
    _lanes_kernel[(b, hkv, splits)](
        q, kc, vc, out, lens, part, lpart,
        q.stride(0), q.stride(2), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        out.stride(0), out.stride(2), *(part.stride()[:3] if splits > 1 else (0, 0, 0)),
        *(lpart.stride()[:2] if splits > 1 else (0, 0)), splits, d**-0.5,
        GROUP=hq // hkv, D=d, BLOCK_M=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_N=block_n, LANES=lanes,
        SPLIT=splits > 1, MASK_ALL=mask_all, num_warps=warps, num_stages=stages)
    if splits > 1:
        combine_splits(part, lpart, out, None, tokens_per_batch=1)
    return out


def check() -> None:
    from pagedflash import flash_attn_with_kvcache

    torch.manual_seed(0)
    for b, n, splits, lanes, bn in [(2, 100, 1, 4, 16), (3, 257, 3, 4, 16), (1, 64, 2, 2, 16), (2, 1000, 5, 4, 16)]:
        q = torch.randn(b, 1, 8, 64)
        kc, vc = torch.randn(b, n, 2, 64), torch.randn(b, n, 2, 64)
        lens = torch.randint(0, n + 1, (b,), dtype=torch.int32)
        want = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        for mask_all in (False, True):
            got = lanes_decode(q, kc, vc, lens, lanes=lanes, block_n=bn, splits=splits, mask_all=mask_all)
            print(b, n, splits, mask_all, lens.tolist(), (got - want).abs().max().item())


def bench(cells) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pagedflash import flash_attn_with_kvcache, validate
    from pagedflash.bench.tune import _time_us

    validate.value_checks(False).__enter__()
    for b, n, splits_list in cells:
        q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, n, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cu = _time_us(partial(F.scaled_dot_product_attention, q.transpose(1, 2), kc.transpose(1, 2),
                                  vc.transpose(1, 2), enable_gqa=True))
        want = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        ours = _time_us(partial(flash_attn_with_kvcache, q, kc, vc, cache_seqlens=lens))
        print(f"B={b} N={n}: cuDNN {cu:.1f} us, library {ours:.1f} us ({cu / ours:.3f})", flush=True)
        for lanes, bn, w, st in [(4, 32, 4, 3), (4, 32, 4, 4), (4, 16, 4, 3), (4, 16, 4, 4), (4, 32, 4, 2),
                                 (2, 32, 4, 3), (2, 64, 4, 3), (8, 16, 8, 3), (4, 64, 4, 2)]:
            for s in splits_list:
                if n // s < lanes * bn:
                    continue
                call = partial(lanes_decode, q, kc, vc, lens, lanes=lanes, block_n=bn, splits=s, warps=w, stages=st)
                try:
                    err = (call() - want).float().abs().max().item()
                    us = _time_us(call)
                    print(f"  lanes={lanes} bn={bn} w={w} st={st} splits={s}: {us:6.1f} us ({cu / us:.3f})"
                          f"  err {err:.2g}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  lanes={lanes} bn={bn} w={w} st={st} splits={s}: {type(e).__name__} {str(e)[:100]}")


if __name__ == "__main__":
    if sys.argv[1:] == ["check"] or os.environ.get("TRITON_INTERPRET") == "1":
        check()
    elif sys.argv[1:]:  # BxN:s1/s2 ...
        bench([(int(c.split("x")[0]), int(c.split("x")[1].split(":")[0]),
                [int(x) for x in c.split(":")[1].split("/")]) for c in sys.argv[1:]])
    else:
        bench([(16, 1024, [1]), (16, 4096, [1]), (4, 1024, [2, 4, 8]), (1, 1024, [8, 16]), (1, 16384, [8, 16, 32]),
               (64, 1024, [1]), (4, 65536, [4, 8])])

"""Launch-choice sweep: the evidence behind the tables in :func:`pagedflash.ops.launch.choose_config`
and :func:`choose_num_splits`.

``python -m pagedflash bench tune`` times candidate tile shapes for prefill and split counts for
decode on the current GPU and prints the best per shape. It is a developer tool: the chosen values
are copied into ``ops/launch.py`` and the run is recorded in docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import warnings

import torch
import triton

from pagedflash.bench.common import time_ms
from pagedflash.bench.decode import FP8, kv_scale, quantize
from pagedflash.cache import cu_seqlens_tensor
from pagedflash.ops.attention import attention_forward
from pagedflash.ops.launch import LaunchConfig
from pagedflash.testing import random_block_table, to_paged

PREFILL_CONFIGS = [
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2),
    (128, 128, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4),
]

# (B, N, Hq, Hkv, D, dtype): the serving grid's split cells (B <= 16) and the seed's sweep
DECODE_CELLS = [(b, n, 32, 8, 128, torch.bfloat16) for b in (1, 4, 16) for n in (1024, 4096, 16384, 65536, 131072)]
DECODE_CELLS += [(4, n, 16, 16, 64, torch.float16) for n in (1024, 2048, 4096, 8192, 16384)]
DECODE_CONFIGS = [(128, 4, 2, True), (64, 4, 3, False), (32, 4, 4, False), (64, 4, 2, True), (64, 4, 4, True)]
DECODE_SPLITS = [1, 2, 4, 8, 16, 32, 64]


def sweep_us(fn, flush: str = "zero") -> float:
    """:func:`~pagedflash.bench.common.time_ms` of a graph replay with the sweep's shorter budgets
    (many candidates per cell), in µs; ``flush="read"`` for the timing floor's second flush."""
    return time_ms(fn, graph=True, flush=flush, warmup_ms=10, rep_ms=30, reps=50) * 1e3


def eager_ms(fn) -> float:
    """:func:`~pagedflash.bench.common.time_ms` of eager calls: prefill tiles (ms-long kernels, so
    launch cost does not matter) and the eager side of the overhead probe."""
    return time_ms(fn, graph=False, warmup_ms=10, rep_ms=40)


def tune_prefill(rows: list, *, dtype=torch.bfloat16) -> None:
    n = 8192
    for d in (64, 128):
        h = 2048 // d
        b = 16384 // n
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=dtype) for _ in range(3))
        for causal in (False, True):
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            for bm, bn, w, s in PREFILL_CONFIGS:
                cfg = LaunchConfig(block_m=bm, block_n=bn, g_pack=1, num_warps=w, num_stages=s, tma=True)

                def run(cfg=cfg, causal=causal):
                    return attention_forward(q, k, v, batch=b, max_seqlen_q=n, max_seqlen_k=n, sm_scale=d**-0.5,
                                             window=(-1, 0 if causal else -1), softcap=0.0, num_splits=1,
                                             config=cfg)
                try:
                    ms = eager_ms(run)
                    tf = flops / ms / 1e9
                except Exception as e:  # noqa: BLE001  (out of shared memory etc.: record and go on)
                    ms, tf = float("nan"), float("nan")
                    print(f"  prefill d={d} causal={causal} cfg={cfg}: {type(e).__name__}")
                rows.append(dict(kind="prefill", d=d, causal=causal, cfg=[bm, bn, w, s], ms=ms, tflops=tf))
                print(f"prefill d={d:3d} causal={causal!s:5} bm={bm:3d} bn={bn:3d} w={w} s={s}: {tf:6.1f} TFLOP/s")


def tune_decode(rows: list, *, cells: list | None = None, splits: list[int] | None = None,
                pages: list[int] | None = None, tiles: list[tuple] | None = None) -> None:
    """Decode tiles x split counts per cell, on the contiguous cache (page 0) and on page pools (a
    random permutation of the pool as block table), with SDPA cuDNN on the contiguous cache timed
    the same way: the evidence for ``choose_config``'s decode rows and ``choose_num_splits``
    (docs/performance.md, v13).
    ``tiles``: (block_n, warps, stages, tma[, g_pack]) to time instead of the default lists, at every page size;
    ``g_pack`` (default: the whole group) packs fewer query heads per program, for more programs."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pagedflash import validate

    splits = splits or DECODE_SPLITS
    for b, n, hq, hkv, d, dtype in cells or DECODE_CELLS:
        fp8 = dtype == FP8  # bf16 q over an e4m3 cache with per-KV-head scales (cuDNN timed on the bf16 cache)
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16 if fp8 else dtype)
        kc, vc = (torch.randn(b, n, hkv, d, device="cuda", dtype=q.dtype) for _ in range(2))
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = sweep_us(functools.partial(F.scaled_dot_product_attention, q.transpose(1, 2), kc.transpose(1, 2),
                                               vc.transpose(1, 2), enable_gqa=True))
        scales = {}
        if fp8:
            scales = {"k_descale": kv_scale(kc), "v_descale": kv_scale(vc)}
            kc, vc = quantize(kc, scales["k_descale"]), quantize(vc, scales["v_descale"])
        shape = [b, n, hq, hkv, d, str(dtype)]
        want = attention_forward(q, kc, vc, batch=b, max_seqlen_q=1, max_seqlen_k=n, sm_scale=d**-0.5,
                                 window=(-1, 0), softcap=0.0, seqused_k=lens, **scales)[0].float()
        print(f"decode B={b} N={n} {hq}/{hkv} D={d} {dtype}: cuDNN {cudnn:.1f} us; splits {splits} then auto "
              "(err: max |out - contiguous auto|)", flush=True)
        for page in pages or [0]:
            table = random_block_table([n // page] * b, b * n // page, device="cuda") if page else None
            k, v = (to_paged(t, page, table) for t in (kc, vc)) if page else (kc, vc)
            for bn, w, st, tma, *g in tiles or (PAGED_DECODE_CONFIGS[page] if page else DECODE_CONFIGS):
                g_pack = g[0] if g else hq // hkv
                if (hq // hkv) % g_pack:
                    raise SystemExit(f"--tiles: g{g_pack} does not divide the GQA group ({hq // hkv}) of {shape}")
                cfg = LaunchConfig(block_m=max(16, triton.next_power_of_2(g_pack)), block_n=bn, g_pack=g_pack,
                                   num_warps=w, num_stages=st, tma=tma)
                times, worst = [], 0.0
                for s in [*splits, 0]:
                    call = functools.partial(attention_forward, q, k, v, batch=b, max_seqlen_q=1, max_seqlen_k=n,
                                             sm_scale=d**-0.5, window=(-1, 0), softcap=0.0, seqused_k=lens,
                                             block_table=table, num_splits=s, config=cfg, **scales)
                    us = err = float("nan")
                    if s <= 1 or n // s >= bn:
                        try:
                            with validate.value_checks(False):
                                err = (call()[0].float() - want).abs().max().item()
                                us = sweep_us(call)
                        except Exception as e:  # noqa: BLE001  (a tile ptxas refuses: record and go on)
                            print(f"  page={page} {cfg} splits={s}: {type(e).__name__}: {str(e)[:80]}")
                        worst = err if err != err else max(worst, err)  # a NaN stays visible
                    rows.append(dict(kind="decode", shape=shape, page=page, cfg=[bn, w, st, tma, g_pack], splits=s, us=us,
                                     err=err, cudnn_us=cudnn))
                    times.append(us)
                best = min((t for t in times if t == t), default=float("nan"))
                line = " ".join(f"{t:6.1f}{'*' if t == best else ' '}" for t in times)
                print(f"  page={page:3d} bn={bn:3d} w={w} s={st} tma={tma!s:5} g={g_pack}: {line}  best/cuDNN {cudnn / best:.2f}"
                      f"  err {worst:.2g}", flush=True)
            k = v = None  # free a pool before the next page size
        q = kc = vc = None
        torch.cuda.empty_cache()


# (block_m, block_n, warps, stages, tma) for chunked prefill over a page pool, by page size
PAGED_PREFILL_CONFIGS = {
    16: [(64, 64, 4, 3, False), (128, 64, 4, 3, False), (128, 128, 8, 3, False), (64, 64, 4, 2, False)],
    64: [(64, 64, 4, 3, True), (64, 64, 4, 3, False), (64, 64, 4, 2, True)],
}
# (block_n, warps, stages, tma) for decode over page pools, by page size (tune_decode --pages)
PAGED_DECODE_CONFIGS = {
    1: [(128, 4, 2, False), (64, 4, 4, False), (32, 4, 4, False)],
    16: [(128, 4, 2, False), (64, 4, 3, False), (64, 4, 4, False), (32, 4, 4, False)],
    64: [(64, 4, 2, True), (64, 4, 4, True), (64, 4, 3, False)],
}
# packed tiles of 64 and 128 rows (speculative verification, short chunks): which ones ptxas compiles
PACK_PROBE = [(bm, bn, 4, st) for bm in (64, 128) for bn in (32, 64) for st in (2, 3)]


def tune_paged(rows: list, *, dtype=torch.bfloat16) -> None:
    """Chunked prefill over a paged prefix: tile, pipeline depth and TMA per page size, against the
    contiguous kernel on the same shape (graph replays); then which packed tiles ptxas compiles.
    Paged decode: :func:`tune_decode` with ``pages``."""
    from pagedflash import flash_attn_func

    hq, hkv, d, new = 32, 8, 128, 512
    for b, cached in ((1, 4096), (1, 16384), (4, 16384)):
        n = cached + new
        q = torch.randn(b, new, hq, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
        flops = 4 * d * hq * b * (new * (n - new) + new * (new + 1) / 2)
        dense_us = sweep_us(lambda: flash_attn_func(q, k, v, causal=True))
        want = flash_attn_func(q, k, v, causal=True).flatten(0, 1)
        print(f"chunked B={b} cached={cached}: dense {dense_us:7.1f} us {flops / dense_us / 1e6:5.0f} TFLOP/s")
        rows.append(dict(kind="chunked", b=b, cached=cached, page=0, cfg=None, us=dense_us))
        cq, ck = cu_seqlens_tensor([new] * b, device="cuda"), cu_seqlens_tensor([n] * b, device="cuda")
        for page, configs in PAGED_PREFILL_CONFIGS.items():
            nb = b * -(-n // page)
            table = random_block_table([nb // b] * b, nb, device="cuda")
            pad = nb // b * page - n
            kp, vp = (to_paged(torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)), page, table) for x in (k, v))
            for bm, bn, w, st, tma in configs:
                cfg = LaunchConfig(block_m=bm, block_n=bn, g_pack=1, num_warps=w, num_stages=st, tma=tma)

                def run(cfg=cfg):
                    return attention_forward(q.flatten(0, 1), kp, vp, batch=b, max_seqlen_q=new, max_seqlen_k=n,
                                             sm_scale=d**-0.5, window=(-1, 0), softcap=0.0, cu_seqlens_q=cq,
                                             cu_seqlens_k=ck, block_table=table, config=cfg)[0]
                try:
                    err = (run().float() - want.float()).abs().max().item()
                    us = sweep_us(run)
                except Exception as e:  # noqa: BLE001
                    print(f"  page={page} cfg={cfg}: {type(e).__name__}")
                    continue
                rows.append(dict(kind="chunked", b=b, cached=cached, page=page, cfg=[bm, bn, w, st, tma], us=us,
                                 err=err))
                print(f"  page={page:3d} bm={bm:3d} bn={bn:3d} w={w} s={st} tma={tma!s:5}: {us:7.1f} us "
                      f"{flops / us / 1e6:5.0f} TFLOP/s  x{dense_us / us:4.2f} dense  err={err:.3g}")
            kp = vp = None  # free the pools before the next page size
    for d in (64, 128):  # compile probe: a short chunk per sequence over a paged cache, GQA 4
        q = torch.randn(40, 8, d, device="cuda", dtype=dtype)
        kp, vp = (torch.randn(8, 16, 2, d, device="cuda", dtype=dtype) for _ in range(2))
        cq = torch.tensor([0, 7, 40], dtype=torch.int32, device="cuda")
        ck = torch.tensor([0, 50, 100], dtype=torch.int32, device="cuda")
        table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
        for bm, bn, w, st in PACK_PROBE:
            cfg = LaunchConfig(block_m=bm, block_n=bn, g_pack=4, num_warps=w, num_stages=st)
            try:
                with warnings.catch_warnings(record=True) as caught:  # a compile failure retries a safe tile
                    warnings.simplefilter("always")
                    attention_forward(q, kp, vp, batch=2, max_seqlen_q=33, max_seqlen_k=50, sm_scale=d**-0.5,
                                      window=(-1, 0), softcap=0.0, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                      block_table=table, num_splits=1, config=cfg)
                    torch.cuda.synchronize()
                status = "fell back: " + str(caught[0].message)[:80] if caught else "ok"
            except Exception as e:  # noqa: BLE001
                status = type(e).__name__
            rows.append(dict(kind="pack_probe", d=d, cfg=[bm, bn, w, st], status=status))
            print(f"pack probe D={d} bm={bm} bn={bn} w={w} s={st}: {status}")


def timing_floor(rows: list) -> None:
    """The floor of this timing method under both L2 flushes (:func:`sweep_us`): a graph of one
    trivial kernel. No sweep can post a time below it."""
    x = torch.zeros(1, device="cuda")
    for flush in ("zero", "read"):
        rows.append(dict(kind="floor", flush=flush, us=sweep_us(lambda: x.add_(1), flush)))
        print(f"timing floor ({flush} flush): one tiny kernel, graph replay: {rows[-1]['us']:.1f} us", flush=True)


def probe_overhead(rows: list) -> None:
    """Where small-decode time goes: eager launch vs the same work replayed from a CUDA graph."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pagedflash import flash_attn_with_kvcache

    for b, hq, hkv, d, dtype, n in [(4, 16, 16, 64, torch.float16, 1024), (1, 32, 8, 128, torch.bfloat16, 16384),
                                    (1, 32, 8, 128, torch.bfloat16, 4096)]:
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype)
        kc, vc = (torch.randn(b, n, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        qt = q.transpose(1, 2).contiguous()
        kt, vt = (x.transpose(1, 2).repeat_interleave(hq // hkv, 1).contiguous() for x in (kc, vc))
        res = {}
        for splits in (1, 4, 8, 16, 0):
            def api(splits=splits):
                return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
            res[f"api_checked_s{splits}"] = time_ms(api, graph=False, warmup_ms=10, rep_ms=40, value_checks=True) * 1e3
            res[f"api_s{splits}"] = eager_ms(api) * 1e3
            res[f"graph_s{splits}"] = time_ms(api, graph=True, warmup_ms=10, rep_ms=40) * 1e3
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def sd(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
            try:
                res[f"sdpa_{name}"] = eager_ms(sd) * 1e3
                res[f"sdpa_{name}_graph"] = time_ms(sd, graph=True, warmup_ms=10, rep_ms=40) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"  sdpa {name}: {type(e).__name__}: {e}"[:200])
        rows.append(dict(kind="overhead", shape=[b, hq, hkv, d, str(dtype), n], us=res))
        print(f"overhead B={b} {hq}/{hkv} D={d} N={n}: " + ", ".join(f"{k}={v:.1f}" for k, v in res.items()))


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": FP8}


def _parse_cell(text: str) -> tuple:
    """``4x16384`` -> the serving grid's shape; ``4x16384@16/16/64/fp16`` -> the seed's."""
    size, _, shape = text.partition("@")
    b, n = map(int, size.split("x"))
    hq, hkv, d, dtype = shape.split("/") if shape else (32, 8, 128, "bf16")
    if dtype not in _DTYPES:
        raise SystemExit(f"--cells: dtype must be one of {sorted(_DTYPES)}, got {dtype!r} in {text!r}")
    return b, n, int(hq), int(hkv), int(d), _DTYPES[dtype]


def _parse_tiles(text: str | None) -> list[tuple] | None:
    """``64:4:3,128:4:2:tma,64:4:3:g2`` -> [(64, 4, 3, False), (128, 4, 2, True), (64, 4, 3, False, 2)]."""
    if not text:
        return None
    tiles = []
    for item in text.split(","):
        bn, w, st, *rest = item.split(":")
        tma = rest[:1] == ["tma"]
        rest = rest[1:] if tma else rest
        if len(rest) > 1 or (rest and not re.fullmatch(r"g[1-9][0-9]*", rest[0])):
            raise SystemExit(f"--tiles: expected block_n:warps:stages[:tma][:gN], got {item!r}")
        tiles.append((int(bn), int(w), int(st), tma, *(int(r[1:]) for r in rest)))
    return tiles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedflash bench tune", description=__doc__)
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--only", choices=["prefill", "decode", "overhead", "paged"], default=None)
    parser.add_argument("--cells", help="decode: BxN[@Hq/Hkv/D/dtype][,...], dtype bf16, fp16, fp32 or fp8 (bf16 q, e4m3 cache), by default the "
                                        "serving grid's shape (32/8/128/bf16); default: its split cells and the "
                                        "seed's sweep")
    parser.add_argument("--splits", help="decode: split counts to time, comma-separated (default: 1,2,4,...,64)")
    parser.add_argument("--pages", default="0", help="decode: page sizes, comma-separated, 0 = the contiguous "
                        f"cache; paged ones from {sorted(PAGED_DECODE_CONFIGS)} (default: %(default)s)")
    parser.add_argument("--tiles", help="decode: tiles to time, block_n:warps:stages[:tma][:gN] (gN: N query heads "
                                        "per program, default the whole group), comma-separated "
                                        "(default: a list per page size)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench tune needs a CUDA GPU")
        return 2
    rows: list = []
    timing_floor(rows)
    if args.only in (None, "prefill"):
        tune_prefill(rows)
    if args.only in (None, "overhead"):
        probe_overhead(rows)
    if args.only in (None, "decode"):
        cells = [_parse_cell(c) for c in args.cells.split(",")] if args.cells else None
        tune_decode(rows, cells=cells, splits=[int(x) for x in args.splits.split(",")] if args.splits else None,
                    pages=[int(x) for x in args.pages.split(",")], tiles=_parse_tiles(args.tiles))
    if args.only in (None, "paged"):
        tune_paged(rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump([{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows],
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

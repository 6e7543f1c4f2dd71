"""``pagedflash bench paged``: what reading K/V through a block table costs, and what it buys.

1. Paged vs contiguous decode, both pagedflash, same run: the decode serving grid (without 128K),
   page sizes 1, 16, 64, block tables a random permutation of the pool. Same bytes read, so the
   time ratio paged/contiguous is the paging overhead (1.00 = free).
2. Chunked prefill over a cached prefix: 512 new tokens on 4K/16K/64K cached tokens, B = 1 and 4,
   Hq/Hkv = 32/8, D=128, bf16, page 16: ``flash_attn_varlen_func(..., block_table=...)`` against
   dense ``flash_attn_func`` of the same shape (q 512, k = prefix + 512, causal bottom-right).
   FLOPs are counted exactly: query row i of Sq new rows sees Sk - Sq + i + 1 keys, so
   FLOPs = 4*D*Hq * B * (Sq*(Sk - Sq) + Sq*(Sq + 1)/2) (both rows of a comparison use this count).
   The same chunks over an fp8 (``float8_e4m3fn``) pool of the same page size: TFLOP/s, its speed
   ratio to the bf16 pool (>= 1: no slower), its error against the unquantized values.
3. Prefix caching: 64 requests sharing a 4K-token prefix, each with its own 128-token suffix
   (Hq/Hkv = 32/8, D=128, bf16, page 16, one layer's K/V; random values stand for the projections).
   :class:`pagedflash.cache.BlockManager` decides which tokens each request computes (the first
   request computes the prefix, the others hit its pages in the same step); one prefill step of the
   whole batch (``write_kv_cache`` of the computed tokens, then one varlen attention over the pool)
   is timed with and without prefix caching.
4. FP8 KV paged decode: ``bench decode``'s fp8 cells over pools of 16- and 64-row pages, fp8 vs bf16
   at the same page size (same columns as ``bench decode``'s fp8 table).
5. Sections 1 and 4 at head dim 64 (Hq/Hkv = 32/8, bf16, B = 4/16/32/64, N = 4K/16K): the heads of the
   engine's 1B model, whose decode reads pages of 16 rows (the tile table's D=64 rows: docs/performance.md v27).
"""

from __future__ import annotations

import itertools
import time

import torch

import pagedflash as pf
from pagedflash._progress import progress
from pagedflash.bench.common import (
    NA,
    Config,
    Measured,
    device,
    failures,
    free_memory,
    geomean,
    human,
    measure,
    randn,
    ratio,
    reference_rows,
    rows_checker,
    tflops,
)
from pagedflash.bench.decode import (
    FP8,
    DecodeInputs,
    fp8_columns,
    fp8_note,
    fp8_row,
    grid_cells,
    kv_scale,
    quantize,
)
from pagedflash.bench.decode import FULL as DECODE_FULL
from pagedflash.bench.decode import QUICK as DECODE_QUICK
from pagedflash.bench.hbm import hbm_bandwidth
from pagedflash.bench.report import Table, panels_by_batch, plot, print_summary, print_table, write_results
from pagedflash.cache import BlockManager, block_table_tensor, cu_seqlens_tensor, slot_mapping_tensor
from pagedflash.reference import dequantize_ref
from pagedflash.testing import random_block_table, to_paged

FULL = dict(
    grid=DECODE_FULL["grid"] | dict(lens=(1024, 4096, 16384, 65536)), pages=(1, 16, 64),
    chunked=dict(batches=(1, 4), prefixes=(4096, 16384, 65536), new=512, heads=(32, 8), dim=128,
                 dtype=torch.bfloat16, pages=(16, 64)),
    prefix=dict(requests=64, prefix=4096, suffix=128, heads=(32, 8), dim=128, dtype=torch.bfloat16, page=16),
    fp8=DECODE_FULL["fp8"] | dict(lens=(1024, 4096, 16384, 65536)), fp8_pages=(16, 64),
    d64=dict(batches=(4, 16, 32, 64), heads=(32, 8), dim=64, dtype=torch.bfloat16, lens=(4096, 16384), max_kv_gb=20),
    d64_pages=(16, 64),
)
QUICK = dict(
    grid=DECODE_QUICK["grid"] | dict(lens=(64,)), pages=(1, 16),
    chunked=dict(batches=(1,), prefixes=(32,), new=16, heads=(2, 1), dim=32, dtype=torch.float16, pages=(16,)),
    prefix=dict(requests=3, prefix=32, suffix=16, heads=(2, 1), dim=32, dtype=torch.float16, page=16),
    fp8=DECODE_QUICK["fp8"], fp8_pages=(16,),
    d64=dict(batches=(1,), heads=(2, 1), dim=64, dtype=torch.float16, lens=(64,), max_kv_gb=40), d64_pages=(16,),
)


def paged_row(b: int, n: int, spec: dict, pages: tuple[int, ...]) -> tuple[dict, list[Measured]]:
    """Contiguous decode and the same cache paged at each page size (fresh inputs, freed on return)."""
    (hq, hkv), d, dtype = spec["heads"], spec["dim"], spec["dtype"]
    inputs = DecodeInputs(b, n, hq, hkv, d, dtype)
    contig = measure(inputs.contiguous(), inputs.check, label=f"contiguous B={b} N={n}")
    row = {"B": b, "N": human(n), "n": n, "contig_us": contig.show(lambda ms: ms * 1e3)}
    cases = [contig]
    for p in pages:
        paged = measure(inputs.paged(p), inputs.check, label=f"paged p={p} B={b} N={n}")
        row[f"p{p}_us"] = paged.show(lambda ms: ms * 1e3)
        row[f"p{p}_over"] = ratio(contig, paged)  # paged.ms / contig.ms
        cases.append(paged)
        free_memory()
    return row, cases


def paged_vs_contiguous(spec: dict, pages: tuple[int, ...], name: str = "paged_decode") -> tuple[Table, int]:
    (hq, hkv), d, dtype = spec["heads"], spec["dim"], spec["dtype"]
    columns = {"B": "B", "N": "N", "contig_us": "contiguous µs"} | {f"p{p}_us": f"page {p} µs" for p in pages} | {
        f"p{p}_over": f"page {p}/contig" for p in pages}
    table = Table(name, f"Paged vs contiguous decode (pagedflash both): Hq/Hkv={hq}/{hkv}, D={d}, "
                  f"{str(dtype)[6:]}, num_splits=auto, block tables = random permutation of the pool",
                  columns, note="page p/contig: time ratio, same run (1.00 = paging is free; >1 = overhead).")
    bad = 0
    cells = [(b, n) for b, n in grid_cells(spec) if all(n % p == 0 for p in pages)]
    for b, n in progress(cells, desc="paged vs contiguous decode"):
        row, cases = paged_row(b, n, spec, pages)
        table.rows.append(row)
        bad += failures(cases)
        free_memory()
    return table, bad


def fp8_paged(spec: dict, pages: tuple[int, ...], name: str = "fp8_paged") -> tuple[Table, int]:
    (hq, hkv), d = spec["heads"], spec["dim"]
    table = Table(name, f"FP8 KV paged decode vs {str(spec['dtype'])[6:]} at the same page size: "
                  f"Hq/Hkv={hq}/{hkv}, D={d}, block tables = random permutation of the pool, num_splits=auto",
                  fp8_columns(spec["dtype"]), note=fp8_note())
    bad = 0
    cells = [(b, n) for b, n in grid_cells(spec) if all(n % p == 0 for p in pages)]
    for b, n in progress(cells, desc="paged decode fp8 vs bf16"):
        inputs = DecodeInputs(b, n, hq, hkv, d, spec["dtype"])
        fp8 = inputs.fp8()
        for p in pages:
            row, cases = fp8_row(inputs, fp8, f"paged p={p} B={b} N={n}", page=p)
            table.rows.append(row)
            bad += failures(cases)
            free_memory()
        del inputs, fp8
        free_memory()
    return table, bad


def causal_flops(sq: int, sk: int, hq: int, d: int) -> int:
    """Exact FLOPs of one sequence's causal (bottom-right) attention: row i sees sk - sq + i + 1 keys."""
    return 4 * d * hq * (sq * (sk - sq) + sq * (sq + 1) // 2)


def chunked_prefill(spec: dict) -> tuple[Table, int]:
    (hq, hkv), d, dtype, pages, new = spec["heads"], spec["dim"], spec["dtype"], spec["pages"], spec["new"]
    columns = {"B": "B", "prefix": "cached", "dense_tflops": "dense TFLOP/s", "dense_us": "dense µs"}
    for p in pages:
        columns |= {f"p{p}_tflops": f"page {p} TFLOP/s", f"p{p}_us": f"page {p} µs", f"p{p}_vs_dense": f"page {p}÷dense",
                    f"p{p}_fp8_tflops": f"page {p} fp8 TFLOP/s", f"p{p}_fp8_vs_bf16": f"page {p} fp8÷bf16",
                    f"p{p}_fp8_err_unquant": f"page {p} fp8 err vs unquantized"}
    table = Table(
        "chunked_prefill", f"Chunked prefill over a cached prefix: {new} new tokens, Hq/Hkv={hq}/{hkv}, D={d}, "
        f"{str(dtype)[6:]}, paged varlen (block tables a random permutation of the pool) vs dense",
        columns,
        note="FLOPs exact for the bottom-right causal mask: 4*D*Hq*B*(Sq*(Sk-Sq) + Sq*(Sq+1)/2). "
             "page p÷dense: speed ratio, same run (>1: paged faster). On an sm90 GPU these launches (B=1: 128 work "
             "items of 128 rows, B=4: 512) take the Gluon kernel, dense and paged alike (TMA copies of min(page, "
             "128) rows); elsewhere the portable kernel runs them, where pages of 64+ rows load "
             "through TMA descriptors and smaller pages gather rows. fp8: the same pool in float8_e4m3fn "
             "(per-KV-head scales amax/448; on sm90 the Gluon kernel converts its tiles to fp16 in shared memory, "
             "the portable kernel loads them through pointers), checked against the reference "
             "over the dequantized cache; fp8÷bf16: speed ratio to the bf16 pool of the same page size "
             "(>= 1: no slower); err vs unquantized: max |out - ref| / max |ref| against the bf16 values.",
    )
    bad = 0
    for b, prefix in progress(list(itertools.product(spec["batches"], spec["prefixes"])), desc="chunked prefill"):
        row, cases = chunked_row(b, prefix, spec)
        table.rows.append(row)
        bad += failures(cases)
        free_memory()
    return table, bad


def chunked_row(b: int, prefix: int, spec: dict) -> tuple[dict, list[Measured]]:
    (hq, hkv), d, dtype, new = spec["heads"], spec["dim"], spec["dtype"], spec["new"]
    sk = prefix + new
    q = randn(b, new, hq, d, dtype=dtype)
    k, v = randn(b, sk, hkv, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype)
    refs = {i: reference_rows(q[i], k[i], v[i], causal=True) for i in sorted({0, b - 1})}
    flops = b * causal_flops(new, sk, hq, d)
    dense = measure(lambda: pf.flash_attn_func(q, k, v, causal=True),
                    rows_checker(refs, dtype, lambda o, i: o[i]), label=f"chunked dense B={b} P={prefix}")
    row = {"B": b, "prefix": human(prefix), "flops": flops, "dense_tflops": dense.show(lambda ms: tflops(flops, ms)),
           "dense_us": dense.show(lambda ms: ms * 1e3), "dense_err": dense.err}
    cases = [dense]
    qp = q.view(b * new, hq, d)
    cu_q, cu_k = cu_seqlens_tensor([new] * b, device=device()), cu_seqlens_tensor([sk] * b, device=device())
    kd, vd = kv_scale(k), kv_scale(v)
    k8, v8 = quantize(k, kd), quantize(v, vd)
    refs8 = {i: reference_rows(q[i], dequantize_ref(k8[i], kd), dequantize_ref(v8[i], vd), causal=True)
             for i in sorted({0, b - 1})}
    for page in spec["pages"]:
        width = -(-sk // page)
        table_ids = random_block_table([width] * b, b * width, device=device())
        pad = width * page - sk  # the last page's tail stays unused
        k_pool, v_pool = (to_paged(torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)), page, table_ids) for x in (k, v))
        paged = measure(
            lambda: pf.flash_attn_varlen_func(qp, k_pool, v_pool, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                              max_seqlen_q=new, max_seqlen_k=sk, causal=True, block_table=table_ids),
            rows_checker(refs, dtype, lambda o, i: o[i * new:(i + 1) * new]),
            label=f"chunked paged p={page} B={b} P={prefix}")
        row |= {f"p{page}_tflops": paged.show(lambda ms: tflops(flops, ms)), f"p{page}_us": paged.show(lambda ms: ms * 1e3),
                f"p{page}_vs_dense": ratio(paged, dense), f"p{page}_err": paged.err}
        cases.append(paged)
        k_pool = v_pool = None
        k8_pool, v8_pool = (to_paged(torch.nn.functional.pad(x.view(torch.uint8), (0, 0, 0, 0, 0, pad)).view(FP8),
                                     page, table_ids) for x in (k8, v8))  # padded as bytes: no fp8 kernels needed

        def fp8_call():
            return pf.flash_attn_varlen_func(qp, k8_pool, v8_pool, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=new,
                                             max_seqlen_k=sk, causal=True, block_table=table_ids, k_descale=kd,
                                             v_descale=vd)

        seq = lambda o, i: o[i * new:(i + 1) * new]  # noqa: E731
        fp8 = measure(fp8_call, rows_checker(refs8, dtype, seq), label=f"chunked paged fp8 p={page} B={b} P={prefix}")
        err = rows_checker(refs, dtype, seq)(fp8_call())[0] if fp8.ok else None
        row |= {f"p{page}_fp8_tflops": fp8.show(lambda ms: tflops(flops, ms)), f"p{page}_fp8_vs_bf16": ratio(fp8, paged),
                f"p{page}_fp8_err": fp8.err, f"p{page}_fp8_err_unquant": err}
        cases.append(fp8)
        k8_pool = v8_pool = None
    return row, cases


class PrefillStep:
    """One prefill step of a batch of requests whose blocks a BlockManager assigned.

    Request r's token t has q/k/v rows ``prefix_x[t]`` for t < P, else ``suffix_x[r, t - P]``. Only
    tokens from ``cached[r]`` on are computed: their K/V are written at their slots, then one varlen
    attention over the pool gives their outputs (causal, bottom-right: each sees its whole prefix)."""

    def __init__(self, manager, tokens: list[list[int]], x: dict[str, torch.Tensor], page: int):
        t0 = time.perf_counter()
        allocs = []
        for r, ids in enumerate(tokens):
            allocs.append(manager.allocate(r, ids))
            # Committed before the step runs, which an engine must not do (its forward may fail):
            # here the one launch of :meth:`run` writes every computed token's K/V before any
            # attention reads the pool, so a later request of the same step may hit these pages.
            manager.commit(r, len(ids))
        self.allocate_ms = (time.perf_counter() - t0) * 1e3
        tables, self.cached = [a[0] for a in allocs], [a[1] for a in allocs]
        self.lengths = [len(ids) for ids in tokens]
        self.new = [n - c for n, c in zip(self.lengths, self.cached)]
        prefix = x["prefix_q"].shape[0]

        def rows(name: str, r: int, start: int) -> torch.Tensor:
            own = x[f"suffix_{name}"][r]
            return torch.cat([x[f"prefix_{name}"], own])[start:] if start < prefix else own[start - prefix:]

        self.q, self.k, self.v = (torch.cat([rows(n, r, c) for r, c in enumerate(self.cached)]) for n in "qkv")
        dev = self.q.device
        self.slots = slot_mapping_tensor(tables, self.cached, self.lengths, page_size=page, device=dev)
        self.block_table = block_table_tensor(tables, device=dev)
        self.cu_q, self.cu_k = (cu_seqlens_tensor(n, device=dev) for n in (self.new, self.lengths))
        self.full = {n: [torch.cat([x[f"prefix_{n}"], x[f"suffix_{n}"][r]]) for r in (0, len(tokens) - 1)] for n in "qkv"}

    def run(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        pf.write_kv_cache(self.k, self.v, k_cache, v_cache, self.slots)
        return pf.flash_attn_varlen_func(self.q, k_cache, v_cache, cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
                                         max_seqlen_q=max(self.new), max_seqlen_k=max(self.lengths), causal=True,
                                         block_table=self.block_table)

    def checker(self, dtype):
        """Outputs of the first and last request against the reference over their full sequences."""
        last = len(self.new) - 1
        refs = {}
        for slot, r in enumerate((0, last)):
            q_new = self.full["q"][slot][self.cached[r]:]
            refs[r] = reference_rows(q_new, self.full["k"][slot], self.full["v"][slot], causal=True)
        cu = self.cu_q.tolist()
        return rows_checker(refs, dtype, lambda o, r: o[cu[r]:cu[r + 1]])

    def flops(self, hq: int, d: int) -> int:
        return sum(causal_flops(sq, sk, hq, d) for sq, sk in zip(self.new, self.lengths))


def prefix_caching(spec: dict) -> tuple[Table, int]:
    (hq, hkv), d, dtype, page = spec["heads"], spec["dim"], spec["dtype"], spec["page"]
    n_req, n_prefix, n_suffix = spec["requests"], spec["prefix"], spec["suffix"]
    table = Table(
        "prefix_caching", f"Prefix caching: {n_req} requests, shared {human(n_prefix)} prefix + {n_suffix} own tokens, "
        f"Hq/Hkv={hq}/{hkv}, D={d}, {str(dtype)[6:]}, page {page}, one layer",
        {"mode": "prefix caching", "computed": "tokens computed", "step_ms": "step ms", "tflops": "TFLOP/s",
         "allocate_ms": "BlockManager ms", "speedup": "speedup", "ideal": "FLOP ratio"},
        note="step = write_kv_cache of the computed tokens + one varlen attention launch over the pool. "
             "speedup = time without / with caching, same run; FLOP ratio = the ideal speedup.",
    )
    gen = torch.Generator().manual_seed(0)
    prefix_ids = torch.randint(0, 32000, (n_prefix,), generator=gen).tolist()
    tokens = [prefix_ids + torch.randint(0, 32000, (n_suffix,), generator=gen).tolist() for _ in range(n_req)]
    x = {f"prefix_{n}": randn(n_prefix, h, d, dtype=dtype) for n, h in (("q", hq), ("k", hkv), ("v", hkv))}
    x |= {f"suffix_{n}": randn(n_req, n_suffix, h, d, dtype=dtype) for n, h in (("q", hq), ("k", hkv), ("v", hkv))}
    num_blocks = n_req * -(-(n_prefix + n_suffix) // page) + 1
    results = {}
    for caching in (False, True):
        row, results[caching] = prefix_row(BlockManager(num_blocks, page, enable_prefix_caching=caching),
                                           tokens, x, spec)
        table.rows.append(row)
        free_memory()
    (off, flops_off), (on, flops_on) = results[False], results[True]
    table.rows[-1].update(speedup=ratio(on, off), ideal=flops_off / flops_on)
    return table, failures([off, on])


def prefix_row(manager, tokens: list[list[int]], x: dict, spec: dict) -> tuple[dict, tuple[Measured, int]]:
    """One prefill step of all requests as ``manager`` assigns them; returns the row and (time, FLOPs)."""
    (hq, hkv), d, dtype, page = spec["heads"], spec["dim"], spec["dtype"], spec["page"]
    step = PrefillStep(manager, tokens, x, page)
    num_blocks = manager.num_blocks
    k_cache, v_cache = (randn(num_blocks, page, hkv, d, dtype=dtype) for _ in range(2))
    caching = manager.enable_prefix_caching
    m = measure(lambda: step.run(k_cache, v_cache), step.checker(dtype), label=f"prefix caching={caching}")
    flops = step.flops(hq, d)
    row = {"mode": "on" if caching else "off", "computed": sum(step.new), "cached_per_request": step.cached[-1],
           "step_ms": m.show(lambda ms: ms), "tflops": m.show(lambda ms: tflops(flops, ms)),
           "allocate_ms": step.allocate_ms, "flops": flops, "err": m.err}
    return row, (m, flops)


def main(cfg: Config) -> int:
    spec = QUICK if cfg.quick else FULL
    print(f"fp8 of peak: TB/s over {hbm_bandwidth()}", flush=True)  # a bad PAGEDFLASH_HBM_TBPS stops here, untimed
    decode, bad_decode = paged_vs_contiguous(spec["grid"], spec["pages"])
    print_table(decode)
    chunked, bad_chunked = chunked_prefill(spec["chunked"])
    print_table(chunked)
    prefix, bad_prefix = prefix_caching(spec["prefix"])
    print_table(prefix)
    fp8, bad_fp8 = fp8_paged(spec["fp8"], spec["fp8_pages"])
    print_table(fp8)
    decode64, bad_decode64 = paged_vs_contiguous(spec["d64"], spec["d64_pages"], name="paged_decode_d64")
    print_table(decode64)
    fp8_64, bad_fp8_64 = fp8_paged(spec["d64"], spec["d64_pages"], name="fp8_paged_d64")
    print_table(fp8_64)
    summary = {f"geomean_page{p}_over_contig": geomean(r[f"p{p}_over"] for r in decode.rows) for p in spec["pages"]}
    summary |= {f"geomean_chunked_page{p}_vs_dense": geomean(r[f"p{p}_vs_dense"] for r in chunked.rows)
                for p in spec["chunked"]["pages"]}
    summary |= {f"geomean_chunked_page{p}_fp8_vs_bf16": geomean(r[f"p{p}_fp8_vs_bf16"] for r in chunked.rows)
                for p in spec["chunked"]["pages"]}
    summary |= {f"fp8_speedup_page{p}_kv_ge_1gb": geomean(r["speedup"] for r in fp8.rows
                                                          if r["page"] == p and r["kv_gb"] >= 1)
                for p in spec["fp8_pages"]}
    summary |= {f"geomean_d64_page{p}_over_contig": geomean(r[f"p{p}_over"] for r in decode64.rows)
                for p in spec["d64_pages"]}
    summary |= {f"fp8_speedup_d64_page{p}": geomean(r["speedup"] for r in fp8_64.rows if r["page"] == p)
                for p in spec["d64_pages"]}
    summary |= {"prefix_caching_speedup": prefix.rows[-1].get("speedup", NA),
                "failures": bad_decode + bad_chunked + bad_prefix + bad_fp8 + bad_decode64 + bad_fp8_64}
    print_summary(summary)
    panels = panels_by_batch(decode.rows, spec["grid"]["batches"], lambda b, rows, xs: {
        "title": f"paged/contiguous decode time, B={b}", "xlabel": "N", "ylabel": "time ratio",
        "series": {f"page {p}": (xs, [r[f"p{p}_over"] for r in rows]) for p in spec["pages"]}})
    plot(cfg.out / "paged_decode.png", panels)
    path = write_results("paged", [decode, chunked, prefix, fp8, decode64, fp8_64], cfg.out, quick=cfg.quick, summary=summary)
    print(f"wrote {path} and {cfg.out / 'paged_decode.png'}")
    return 1 if summary["failures"] else 0


"""``pagedflash bench decode``: split-KV decode (q_len = 1) against a contiguous cache.

1. The seed's sweep: B=4, Hq=Hkv=16, D=64, fp16, N in 1K..16K, num_splits in {1, 8, ..., 128} and
   auto (0): microseconds per cell, the best split per N, auto's time over the best's, and SDPA.
2. The serving grid: B in {1, 4, 16, 64}, Hq/Hkv = 32/8, D=128, bf16, N in 1K..128K (cells whose
   K+V exceed 40 GB skipped): microseconds, TB/s of bytes read (K+V + Q + O), the fraction of the
   GPU's datasheet HBM bandwidth (:func:`~pagedflash.bench.hbm.hbm_bandwidth`), and the speed
   ratio to SDPA cuDNN and flash from the same run.
3. FP8 KV: the serving grid's cells (bf16 K+V up to ``max_kv_gb`` of the fp8 spec) with the same
   caches quantized to ``float8_e4m3fn`` (per-KV-head scales from the data, amax / 448), contiguous:
   fp8 and bf16 microseconds in the same run, the speedup, TB/s of the bytes the fp8 call moves (K+V
   at one byte, Q and O at two), and the error against the reference over the dequantized cache
   (checked, bf16's tolerance) and against the unquantized bf16 values (reported).

``--batch-invariant`` adds to the serving grid a paged cache (16-token pages, the engine's default)
and, for the contiguous call, the paged one and the fp8 one, the same call with
``batch_invariant=True`` timed in the same run: its microseconds and its time over the default's
per cell, and their geometric means in the summary (issue 32's target: <= 1.15x). The default side
is the mode off whatever ``PAGEDFLASH_BATCH_INVARIANT`` says.

Every call is ``flash_attn_with_kvcache(q [B,1,Hq,D], k_cache, v_cache, cache_seqlens=N,
num_splits=s)`` over random caches (the serving grid also times ``cache_seqlens=None``, the whole
cache, which is what SDPA computes); do_bench flushes L2 before each call, so even a 4 MB cache is
read from HBM. SDPA gets q ``[B,Hq,1,D]`` and K/V ``[B,Hkv,N,D]`` (``enable_gqa=True`` when the
backend takes it, else expanded to Hq heads: see the ``sdpa`` column), ``is_causal=False``.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

import pagedflash as pf
from pagedflash._progress import progress
from pagedflash.batch_invariance import batch_invariant
from pagedflash.bench.common import (
    INVARIANT_NOTE,
    NA,
    Config,
    Measured,
    bhsd,
    failures,
    free_memory,
    geomean,
    host_us,
    human,
    invariant_x,
    measure,
    measure_sdpa,
    randn,
    ratio,
    tbps,
)
from pagedflash.bench.hbm import hbm_bandwidth
from pagedflash.bench.report import (
    Table,
    heatmap,
    panels_by_batch,
    plot,
    print_summary,
    print_table,
    write_results,
)
from pagedflash.testing import check_close, random_block_table, to_paged

FULL = dict(
    seed=dict(batch=4, heads=(16, 16), dim=64, dtype=torch.float16, lens=(1024, 2048, 4096, 8192, 16384),
              splits=(1, 8, 16, 32, 64, 128)),
    grid=dict(batches=(1, 4, 16, 64), heads=(32, 8), dim=128, dtype=torch.bfloat16,
              lens=(1024, 4096, 16384, 65536, 131072), max_kv_gb=40),
    fp8=dict(batches=(1, 4, 16, 64), heads=(32, 8), dim=128, dtype=torch.bfloat16,
             lens=(1024, 4096, 16384, 65536, 131072), max_kv_gb=20),
)
QUICK = dict(
    seed=dict(batch=2, heads=(2, 2), dim=32, dtype=torch.float16, lens=(32, 64), splits=(1, 2)),
    grid=dict(batches=(1, 2), heads=(2, 1), dim=32, dtype=torch.float16, lens=(64,), max_kv_gb=40),
    fp8=dict(batches=(1, 2), heads=(2, 1), dim=32, dtype=torch.float16, lens=(64,), max_kv_gb=40),
)
FP8 = torch.float8_e4m3fn
AUTO = 0


def kv_bytes(b: int, n: int, hkv: int, d: int, dtype) -> int:
    return b * n * hkv * d * 2 * dtype.itemsize


def decode_bytes(b: int, n: int, hq: int, hkv: int, d: int, dtype, kv_dtype=None) -> int:
    """Bytes one decode step must move: K+V read (in ``kv_dtype``, default q's), plus Q read and O written."""
    return kv_bytes(b, n, hkv, d, kv_dtype or dtype) + 2 * b * hq * d * dtype.itemsize


class DecodeInputs:
    """Random q ``[B,1,Hq,D]`` and contiguous caches ``[B,N,Hkv,D]`` filled to N, plus the fp32
    reference output of the first and last sequence (``check`` compares an output with it)."""

    def __init__(self, b: int, n: int, hq: int, hkv: int, d: int, dtype):
        from pagedflash.reference import kvcache_attention_ref

        self.shape, self.dtype = (b, n, hq, hkv, d), dtype
        self.q = randn(b, 1, hq, d, dtype=dtype)
        self.k, self.v = randn(b, n, hkv, d, dtype=dtype), randn(b, n, hkv, d, dtype=dtype)
        self.seqlens = torch.full((b,), n, dtype=torch.int32, device=self.q.device)
        self.rows = sorted({0, b - 1})
        self.ref, _ = kvcache_attention_ref(self.q[self.rows], self.k[self.rows], self.v[self.rows],
                                            self.seqlens[self.rows])

    def check(self, out: torch.Tensor) -> tuple[float, bool]:
        """``out`` ``[B, 1, Hq, D]`` against the reference rows."""
        return check_close(out[self.rows], self.ref, self.dtype)

    def sdpa_check(self, out: torch.Tensor) -> tuple[float, bool]:
        return self.check(out.transpose(1, 2))

    def contiguous(self, num_splits: int = AUTO, lengths: bool = True, batch_invariant: bool | None = None):
        """The call over the contiguous cache; ``lengths=False`` passes no ``cache_seqlens`` (the whole
        cache, which is what SDPA computes: no lengths to read before the first K/V address).
        ``batch_invariant``: the entry point's argument (None: the process default)."""
        seqlens = self.seqlens if lengths else None
        return lambda: pf.flash_attn_with_kvcache(self.q, self.k, self.v, cache_seqlens=seqlens, num_splits=num_splits,
                                                  batch_invariant=batch_invariant)

    def paged_pool(self, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_pool, v_pool, block_table): the cache as ``page``-token blocks in a random order."""
        b, n = self.shape[:2]
        table = random_block_table([n // page] * b, b * n // page, device=self.q.device)
        return to_paged(self.k, page, table), to_paged(self.v, page, table), table

    def paged(self, page: int, num_splits: int = AUTO, batch_invariant: bool | None = None, pool=None):
        """The call over the same cache as a pool of ``page``-token blocks in a random order, read
        through a block table (same values, so :meth:`check` applies); ``pool``: one from
        :meth:`paged_pool` to reuse."""
        k_pool, v_pool, table = pool or self.paged_pool(page)
        return lambda: pf.flash_attn_with_kvcache(self.q, k_pool, v_pool, cache_seqlens=self.seqlens,
                                                  block_table=table, num_splits=num_splits,
                                                  batch_invariant=batch_invariant)

    def fp8(self) -> Fp8Inputs:
        return Fp8Inputs(self)

    def sdpa(self) -> dict[str, Measured]:
        """SDPA cuDNN and flash on transposed copies (made here; the [B,N,H,D] caches are kept)."""
        qt, kt, vt = bhsd(self.q), bhsd(self.k), bhsd(self.v)
        out = {name: measure_sdpa(name, qt, kt, vt, causal=False, check=self.sdpa_check, label=f"SDPA {name}")
               for name in ("cudnn", "flash")}
        del qt, kt, vt
        free_memory()
        return out


def kv_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-KV-head fp32 scales of x ``[..., Hkv, D]`` that map its largest magnitude to e4m3's 448."""
    amax = x.abs().amax(dim=tuple(i for i in range(x.dim()) if i != x.dim() - 2)).float()
    return (amax / torch.finfo(FP8).max).clamp_min(1e-12)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x ``[B, N, Hkv, D]`` stored as fp8 with ``scale`` (the reference's rounding), one row at a time
    (the fp32 intermediate of a whole 128K-token cache would not fit next to it)."""
    from pagedflash.reference import quantize_fp8_ref

    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    for b in range(x.shape[0]):
        out[b].copy_(quantize_fp8_ref(x[b], scale, FP8))
    return out


class Fp8Inputs:
    """A :class:`DecodeInputs`' caches quantized to fp8, the reference over the dequantized first
    and last rows, and the same calls with ``k_descale``/``v_descale``."""

    def __init__(self, base: DecodeInputs):
        from pagedflash.reference import dequantize_ref, kvcache_attention_ref

        self.base, rows = base, base.rows
        self.kd, self.vd = kv_scale(base.k), kv_scale(base.v)
        self.k, self.v = quantize(base.k, self.kd), quantize(base.v, self.vd)
        k_rows = torch.stack([dequantize_ref(self.k[r], self.kd) for r in rows])  # row by row: fp32 is 4x fp8
        v_rows = torch.stack([dequantize_ref(self.v[r], self.vd) for r in rows])
        self.ref, _ = kvcache_attention_ref(base.q[rows], k_rows, v_rows, base.seqlens[rows])

    def check(self, out: torch.Tensor) -> tuple[float, bool]:
        """Against the reference over the dequantized cache, with the tolerance of q's dtype."""
        return check_close(out[self.base.rows], self.ref, self.base.dtype)

    def unquantized_err(self, fn) -> float:
        """Relative error of ``fn()``'s output against the reference over the original (unquantized) cache."""
        return self.base.check(fn())[0]

    def contiguous(self, num_splits: int = AUTO, batch_invariant: bool | None = None):
        b = self.base
        return lambda: pf.flash_attn_with_kvcache(b.q, self.k, self.v, cache_seqlens=b.seqlens, num_splits=num_splits,
                                                  k_descale=self.kd, v_descale=self.vd, batch_invariant=batch_invariant)

    def paged(self, page: int, num_splits: int = AUTO):
        b = self.base
        n = b.shape[1]
        table = random_block_table([n // page] * b.shape[0], b.shape[0] * n // page, device=b.q.device)
        k_pool, v_pool = (to_paged(x, page, table) for x in (self.k, self.v))
        return lambda: pf.flash_attn_with_kvcache(b.q, k_pool, v_pool, cache_seqlens=b.seqlens, block_table=table,
                                                  num_splits=num_splits, k_descale=self.kd, v_descale=self.vd)


def fp8_row(inputs: DecodeInputs, fp8: Fp8Inputs, label: str, page: int = 0) -> tuple[dict, list[Measured]]:
    """bf16 and fp8 decode of the same cells (contiguous, or paged at ``page``): times, speedup, fp8
    TB/s, errors against the dequantized (checked) and unquantized (reported) references."""
    b, n, hq, hkv, d = inputs.shape
    call16 = inputs.paged(page) if page else inputs.contiguous()
    call8 = fp8.paged(page) if page else fp8.contiguous()
    bf16 = measure(call16, inputs.check, label=f"{label} bf16")
    ours = measure(call8, fp8.check, label=f"{label} fp8")
    nbytes = decode_bytes(b, n, hq, hkv, d, inputs.dtype, kv_dtype=FP8)
    row = {"B": b, "N": human(n), "n": n, "page": page or "contig", "kv_gb": kv_bytes(b, n, hkv, d, inputs.dtype) / 1e9,
           "bf16_us": bf16.show(lambda ms: ms * 1e3), "fp8_us": ours.show(lambda ms: ms * 1e3),
           "speedup": ratio(ours, bf16), "fp8_tbps": ours.show(lambda ms: tbps(nbytes, ms)),
           "of_peak": ours.show(lambda ms: tbps(nbytes, ms) / hbm_bandwidth().tbps), "err_dequant": ours.err,
           "err_unquant": fp8.unquantized_err(call8) if ours.ok else None, "err_bf16": bf16.err}
    return row, [bf16, ours]


def fp8_columns(dtype) -> dict[str, str]:
    """Columns of an fp8 table whose 16-bit side (q, out and the compared cache) is ``dtype``
    (bf16 in the full run; JSON keys say bf16 either way)."""
    dt = str(dtype).removeprefix("torch.")
    return {"B": "B", "N": "N", "page": "page", "kv_gb": f"{dt} K+V GB", "bf16_us": f"{dt} µs", "fp8_us": "fp8 µs",
            "speedup": "fp8 speedup", "fp8_tbps": "fp8 TB/s", "of_peak": f"of {hbm_bandwidth().tbps:g} TB/s",
            "err_dequant": "err vs dequantized", "err_unquant": "err vs unquantized", "err_bf16": f"{dt} err"}


FP8_NOTE = ("fp8 = float8_e4m3fn K/V, per-KV-head scales amax/448 from the data, q/out 16-bit; same shapes, "
            "same run. speedup = 16-bit cache time / fp8 time. fp8 TB/s counts K+V at one byte plus Q and O. "
            "err = max |out - ref| / max |ref|: vs the reference over the dequantized cache (checked with "
            "q's dtype's tolerance), vs the unquantized cache (quantization error, reported), and the 16-bit "
            "cache's own for scale.")


def fp8_note() -> str:
    """:data:`FP8_NOTE` and the HBM figure the ``of_peak`` column divides by."""
    return f"{FP8_NOTE} of peak = fp8 TB/s / {hbm_bandwidth()}."


def fp8_grid(spec: dict, invariant: bool = False) -> tuple[Table, int]:
    """``invariant``: each fp8 call also timed with ``batch_invariant=True`` (columns ``fp8_inv_us``, ``fp8_inv_x``)."""
    (hq, hkv), d, dtype = spec["heads"], spec["dim"], spec["dtype"]
    columns = fp8_columns(dtype) | ({"fp8_inv_us": "fp8 invariant µs", "fp8_inv_x": "fp8 inv x"} if invariant else {})
    table = Table("fp8", f"FP8 KV decode vs {str(dtype)[6:]}, same shapes: Hq/Hkv={hq}/{hkv}, D={d}, "
                  "contiguous cache, num_splits=auto", columns,
                  note=fp8_note() + (" " + INVARIANT_NOTE if invariant else ""))
    bad = 0
    for b, n in progress(grid_cells(spec), desc="decode fp8 vs bf16"):
        inputs = DecodeInputs(b, n, hq, hkv, d, dtype)
        fp8 = inputs.fp8()
        row, cases = fp8_row(inputs, fp8, f"decode B={b} N={n}")
        if invariant:
            on = measure(fp8.contiguous(batch_invariant=True), fp8.check, label=f"decode B={b} N={n} fp8 invariant")
            row.update(fp8_inv_us=on.show(lambda ms: ms * 1e3), fp8_inv_x=invariant_x(cases[1], on), fp8_inv_err=on.err)
            cases.append(on)
        table.rows.append(row)
        bad += failures(cases)
        del inputs, fp8
        free_memory()
    return table, bad


def seed_sweep(spec: dict) -> tuple[Table, list[list], int]:
    (hq, hkv), d, b, dtype, splits = spec["heads"], spec["dim"], spec["batch"], spec["dtype"], spec["splits"]
    columns = {"N": "N"} | {f"s{s}": f"s={s}" for s in splits} | {
        "auto": "auto", "best_split": "best s", "auto_over_best": "auto/best time", "auto_like": "auto ≈ s",
        "cudnn": "SDPA cuDNN", "flash": "SDPA flash", "best_vs_cudnn": "best÷cuDNN", "auto_vs_cudnn": "auto÷cuDNN"}
    table = Table("splits", f"Decode µs by num_splits: B={b}, Hq/Hkv={hq}/{hkv}, D={d}, {str(dtype)[6:]}",
                  columns, note="auto = num_splits=0; 'auto ≈ s' is the fixed split whose time is closest. "
                  "÷cuDNN: speed ratio (>1: pagedflash faster).")
    heat, bad = [], 0
    for n in progress(spec["lens"], desc="decode num_splits sweep"):
        inputs = DecodeInputs(b, n, hq, hkv, d, dtype)
        cases = {s: measure(inputs.contiguous(s), inputs.check, label=f"decode N={n} s={s}")
                 for s in (*splits, AUTO)}
        bad += failures(cases.values())
        sdpa = inputs.sdpa()
        us = {s: m.show(lambda ms: ms * 1e3) for s, m in cases.items()}
        row = {"N": human(n)} | {f"s{s}": us[s] for s in splits} | {"auto": us[AUTO]}
        timed = {s: m for s, m in cases.items() if s != AUTO and m.ok}
        if timed:
            best = min(timed, key=lambda s: timed[s].ms)
            row.update(best_split=best, best_us=timed[best].ms * 1e3, best_vs_cudnn=ratio(timed[best], sdpa["cudnn"]))
            if cases[AUTO].ok:
                row["auto_over_best"] = cases[AUTO].ms / timed[best].ms
                row["auto_like"] = min(timed, key=lambda s: abs(timed[s].ms - cases[AUTO].ms))
        row.update(cudnn=sdpa["cudnn"].show(lambda ms: ms * 1e3), flash=sdpa["flash"].show(lambda ms: ms * 1e3),
                   auto_vs_cudnn=ratio(cases[AUTO], sdpa["cudnn"]),
                   host_us=host_us(inputs.contiguous(AUTO)) if cases[AUTO].ok else None,
                   errors={s: m.err for s, m in cases.items()})
        table.rows.append(row)
        heat.append([us[s] for s in (*splits, AUTO)])
        del inputs
        free_memory()
    return table, heat, bad


def grid_cells(spec: dict) -> list[tuple[int, int]]:
    """(B, N) pairs of the serving grid whose K+V fit under ``max_kv_gb``."""
    hkv, d = spec["heads"][1], spec["dim"]
    return [(b, n) for b, n in itertools.product(spec["batches"], spec["lens"])
            if kv_bytes(b, n, hkv, d, spec["dtype"]) <= spec["max_kv_gb"] * 1e9]


INVARIANT_COLUMNS = {"inv_us": "invariant µs", "inv_x": "inv x", "p16_us": "paged µs", "p16_inv_us": "paged invariant µs",
                     "p16_inv_x": "paged inv x"}


def serving_grid(spec: dict, invariant: bool = False) -> tuple[Table, int]:
    """``invariant``: the contiguous call also timed with ``batch_invariant=True``, and a paged cache
    (16-token pages) timed both ways (:data:`INVARIANT_COLUMNS`)."""
    (hq, hkv), d, dtype = spec["heads"], spec["dim"], spec["dtype"]
    table = Table(
        "grid", f"Decode serving grid: Hq/Hkv={hq}/{hkv}, D={d}, {str(dtype)[6:]}, num_splits=auto",
        {"B": "B", "N": "N", "kv_gb": "K+V GB", "us": "pagedflash µs", "tbps": "TB/s",
         "of_peak": f"of {hbm_bandwidth().tbps:g} TB/s", "cudnn_us": "cuDNN µs", "flash_us": "flash µs",
         "vs_cudnn": "pf÷cuDNN", "vs_flash": "pf÷flash", "full_us": "pf µs, no lengths", "full_vs_cudnn":
         "no lengths÷cuDNN", "host_us": "host µs", "sdpa": "SDPA GQA"},
        note="pagedflash µs: with a cache_seqlens tensor (N for every row), as a serving engine calls it; "
             "'no lengths': cache_seqlens=None, the whole cache, which is what SDPA computes. "
             "TB/s counts K+V read + Q + O (SDPA's TB/s uses the same bytes); of peak = TB/s / "
             f"{hbm_bandwidth()}. pf÷X: speed ratio, same run "
             "(>1: pagedflash faster). L2 is flushed before every timed call, so small caches come from HBM too. "
             "host µs: host time to enqueue one pagedflash call (above the kernel time, back-to-back calls are "
             "launch-bound without CUDA graphs; do_bench's L2 flush hides up to ~50-90 µs of it). "
             "SDPA GQA: gqa-native = enable_gqa=True; gqa-expanded = K/V repeated to Hq heads (reads G x the bytes).",
    )
    if invariant:
        table.columns |= INVARIANT_COLUMNS
        table.note += " paged: the same cache in 16-token pages (random order), num_splits=auto. " + INVARIANT_NOTE
    bad = 0
    for b, n in progress(grid_cells(spec), desc="decode serving grid"):
        inputs = DecodeInputs(b, n, hq, hkv, d, dtype)
        ours = measure(inputs.contiguous(), inputs.check, label=f"decode B={b} N={n}")
        full = measure(inputs.contiguous(lengths=False), inputs.check, label=f"decode B={b} N={n} no lengths")
        bad += failures([ours, full])
        host = host_us(inputs.contiguous()) if ours.ok else None
        sdpa = inputs.sdpa()
        nbytes = decode_bytes(b, n, hq, hkv, d, dtype)
        table.rows.append({
            "B": b, "N": human(n), "n": n, "kv_gb": kv_bytes(b, n, hkv, d, dtype) / 1e9,
            "us": ours.show(lambda ms: ms * 1e3), "tbps": ours.show(lambda ms: tbps(nbytes, ms)),
            "of_peak": ours.show(lambda ms: tbps(nbytes, ms) / hbm_bandwidth().tbps),
            "cudnn_us": sdpa["cudnn"].show(lambda ms: ms * 1e3), "flash_us": sdpa["flash"].show(lambda ms: ms * 1e3),
            "cudnn_tbps": sdpa["cudnn"].show(lambda ms: tbps(nbytes, ms)),
            "flash_tbps": sdpa["flash"].show(lambda ms: tbps(nbytes, ms)),
            "vs_cudnn": ratio(ours, sdpa["cudnn"]), "vs_flash": ratio(ours, sdpa["flash"]),
            "full_us": full.show(lambda ms: ms * 1e3), "full_vs_cudnn": ratio(full, sdpa["cudnn"]),
            "host_us": host, "err": ours.err,
            "sdpa": " ".join(f"{name}:{m.note if m.ok else m.status}" for name, m in sdpa.items()),
        })
        if invariant:
            bad += invariant_cells(inputs, ours, table.rows[-1], f"decode B={b} N={n}")
        del inputs
        free_memory()
    return table, bad


def invariant_cells(inputs: DecodeInputs, off: Measured, row: dict, label: str, page: int = 16) -> int:
    """A serving-grid cell with the batch-invariant mode on (contiguous, whose default side is
    ``off``) and a paged cache both ways: :data:`INVARIANT_COLUMNS` into ``row``; returns failures."""
    on = measure(inputs.contiguous(batch_invariant=True), inputs.check, label=f"{label} invariant")
    pool = inputs.paged_pool(page)
    p_off = measure(inputs.paged(page, pool=pool), inputs.check, label=f"{label} paged")
    p_on = measure(inputs.paged(page, batch_invariant=True, pool=pool), inputs.check, label=f"{label} paged invariant")
    del pool
    us = {key: m.show(lambda ms: ms * 1e3) for key, m in (("inv_us", on), ("p16_us", p_off), ("p16_inv_us", p_on))}
    row.update(us, inv_x=invariant_x(off, on), p16_inv_x=invariant_x(p_off, p_on), inv_err=on.err, p16_inv_err=p_on.err)
    return failures([on, p_off, p_on])


def main(cfg: Config) -> int:
    # with --batch-invariant the default side is the mode off, whatever the environment says
    with batch_invariant(False) if cfg.batch_invariant else contextlib.nullcontext():
        return _main(cfg)


def _main(cfg: Config) -> int:
    spec = QUICK if cfg.quick else FULL
    print(f"of peak: TB/s over {hbm_bandwidth()}", flush=True)  # a bad PAGEDFLASH_HBM_TBPS stops here, untimed
    splits_table, heat, bad_seed = seed_sweep(spec["seed"])
    print_table(splits_table)
    grid, bad_grid = serving_grid(spec["grid"], cfg.batch_invariant)
    print_table(grid)
    fp8, bad_fp8 = fp8_grid(spec["fp8"], cfg.batch_invariant)
    print_table(fp8)
    summary = {
        "geomean_pf_vs_cudnn": geomean(r["vs_cudnn"] for r in grid.rows),
        "geomean_pf_vs_flash": geomean(r["vs_flash"] for r in grid.rows),
        "geomean_no_lengths_vs_cudnn": geomean(r["full_vs_cudnn"] for r in grid.rows),
        "geomean_auto_over_best": geomean(r.get("auto_over_best", NA) for r in splits_table.rows),
        "fp8_speedup_kv_ge_1gb": geomean(r["speedup"] for r in fp8.rows if r["kv_gb"] >= 1),
        "fp8_speedup_kv_256mb_1gb": geomean(r["speedup"] for r in fp8.rows if 0.256 <= r["kv_gb"] < 1),
        "failures": bad_seed + bad_grid + bad_fp8,
    }
    if cfg.batch_invariant:
        summary.update(geomean_invariant_x=geomean(r["inv_x"] for r in grid.rows),
                       geomean_invariant_x_paged=geomean(r["p16_inv_x"] for r in grid.rows),
                       geomean_invariant_x_fp8=geomean(r["fp8_inv_x"] for r in fp8.rows))
    print_summary(summary)

    s = spec["seed"]
    heatmap(cfg.out / "decode_splits.png", heat, rows=[human(n) for n in s["lens"]],
            cols=[*s["splits"], "auto"], title=f"decode µs, B={s['batch']} H={s['heads'][0]} D={s['dim']}",
            xlabel="num_splits", ylabel="N")
    g = spec["grid"]
    panels = panels_by_batch(grid.rows, g["batches"], lambda b, rows, xs: {
        "title": f"B={b}, Hq/Hkv={g['heads'][0]}/{g['heads'][1]}, D={g['dim']}", "xlabel": "N",
        "ylabel": "TB/s (K+V+Q+O)", "hline": (hbm_bandwidth().tbps, f"HBM {hbm_bandwidth()}"), "series": {
            "pagedflash": (xs, [r["tbps"] for r in rows]),
            "SDPA cuDNN": (xs, [r["cudnn_tbps"] for r in rows]),
            "SDPA flash": (xs, [r["flash_tbps"] for r in rows])}})
    plot(cfg.out / "decode_grid.png", panels)
    path = write_results("decode", [splits_table, grid, fp8], cfg.out, quick=cfg.quick, summary=summary)
    print(f"wrote {path}, {cfg.out / 'decode_splits.png'} and {cfg.out / 'decode_grid.png'}")
    return 1 if summary["failures"] else 0

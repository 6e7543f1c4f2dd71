"""``pagedflash bench prefill``: the seed's memory table, then prefill TFLOP/s against SDPA.

1. Peak extra memory (beyond q, k, v; output included) of naive ``softmax(QK^T * scale) V`` in plain
   torch fp16 ops, pagedflash and SDPA, fp16 B=4, H=16, D=64, N = 4K/8K/16K. Naive needs
   ~2 * B*H*N^2 * 2 bytes (68.9 GB at 16K): whatever happens is reported, OOM included.
2. TFLOP/s with B*N = 16K tokens and Hq*D = 2048 (Hq = Hkv), D in {64, 128}, N in 1K..16K, causal
   and not, fp16 and bf16: pagedflash dense, pagedflash varlen (the same B sequences packed), SDPA
   flash, SDPA cuDNN. FLOPs = 4*B*Hq*N^2*D, halved for causal (the flash-attn convention).
   Ratios are throughput ratios from the same run (>1: pagedflash faster).

``--batch-invariant`` times pagedflash dense and varlen of every cell of (2) again with
``batch_invariant=True`` in the same run (on Hopper the Gluon kernel's invariant variant): TFLOP/s,
the time over the default's per cell, and its geometric mean in the summary (issue 32's target:
<= 1.15x). The default side is the mode off whatever ``PAGEDFLASH_BATCH_INVARIANT`` says.
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
    OOM,
    Config,
    Measured,
    bhsd,
    device,
    failures,
    free_memory,
    geomean,
    has_gpu,
    human,
    invariant_x,
    measure,
    measure_sdpa,
    randn,
    ratio,
    reference_rows,
    rows_checker,
    tflops,
)
from pagedflash.bench.report import Table, plot, print_summary, print_table, write_results
from pagedflash.cache import cu_seqlens_tensor

FULL = dict(
    memory=dict(batch=4, heads=16, dim=64, lens=(4096, 8192, 16384), dtype=torch.float16),
    dims=(64, 128), lens=(1024, 2048, 4096, 8192, 16384), tokens=16384, width=2048,
    dtypes=(torch.float16, torch.bfloat16),
)
QUICK = dict(
    memory=dict(batch=1, heads=1, dim=32, lens=(32,), dtype=torch.float16),
    dims=(32,), lens=(16, 32), tokens=64, width=32, dtypes=(torch.float16,),
)
IMPLS = {"dense": "pagedflash", "varlen": "pagedflash varlen", "flash": "SDPA flash", "cudnn": "SDPA cuDNN"}


def naive_attention(q, k, v):
    """softmax(Q K^T * scale) V with plain torch ops in the input dtype. q/k/v ``[B, H, N, D]``."""
    scale = q.shape[-1] ** -0.5
    return torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1) @ v


def peak_extra_gb(fn, warm: bool = True) -> float | str:
    """Peak memory allocated during ``fn()`` above what was allocated before it, in GB (1e9).
    ``warm`` runs it once first so compilation/autotuning buffers are not counted."""
    try:
        if warm:
            fn()
        free_memory()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return peak / 1e9
    except torch.OutOfMemoryError:
        return OOM
    except RuntimeError as e:  # an SDPA backend that refuses the shape
        return f"{NA} ({str(e).splitlines()[0][:40]})"
    except Exception as e:  # a kernel that fails to build or run: reported, the table goes on
        return f"error ({type(e).__name__})"
    finally:
        free_memory()


def _under(backend, q, k, v):
    from torch.nn.attention import sdpa_kernel

    def fn():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return fn


def memory_row(n: int, spec: dict) -> dict:
    """Peak extra GB of each implementation at one N (fresh inputs; freed on return)."""
    from torch.nn.attention import SDPBackend

    b, h, d, dtype = spec["batch"], spec["heads"], spec["dim"], spec["dtype"]
    row = {"N": human(n)}
    if not has_gpu():
        return row | dict(naive=NA, pagedflash=NA, sdpa_flash=NA, sdpa_cudnn=NA, naive_over_pf=NA,
                          note="peak memory needs CUDA")
    q, k, v = (randn(b, n, h, d, dtype=dtype) for _ in range(3))
    qt, kt, vt = map(bhsd, (q, k, v))
    row["pagedflash"] = peak_extra_gb(lambda: pf.flash_attn_func(q, k, v))
    row["sdpa_flash"] = peak_extra_gb(_under(SDPBackend.FLASH_ATTENTION, qt, kt, vt))
    row["sdpa_cudnn"] = peak_extra_gb(_under(SDPBackend.CUDNN_ATTENTION, qt, kt, vt))
    row["naive"] = peak_extra_gb(lambda: naive_attention(qt, kt, vt), warm=False)
    both = isinstance(row["naive"], float) and isinstance(row["pagedflash"], float)
    row["naive_over_pf"] = row["naive"] / row["pagedflash"] if both else NA
    return row


def memory_table(spec: dict) -> Table:
    b, h, d, dtype = spec["batch"], spec["heads"], spec["dim"], spec["dtype"]
    table = Table(
        "memory", f"Prefill peak extra memory, GB (beyond q, k, v; output included): {str(dtype)[6:]} "
        f"B={b}, H={h}, D={d}, non-causal",
        {"N": "N", "naive": "naive", "pagedflash": "pagedflash", "sdpa_flash": "SDPA flash",
         "sdpa_cudnn": "SDPA cuDNN", "naive_over_pf": "naive / pagedflash"},
        note="naive = softmax(QK^T*scale)V in plain torch ops; it materializes two [B,H,N,N] tensors.",
    )
    for n in spec["lens"]:
        table.rows.append(memory_row(n, spec))
        free_memory()
    return table


def sweep_case(dtype, d: int, causal: bool, n: int, spec: dict, invariant: bool = False) -> tuple[dict, list[Measured]]:
    """One (dtype, D, causal, N) cell: check then time the four implementations (``invariant``: and
    pagedflash's two with ``batch_invariant=True``)."""
    b, h = spec["tokens"] // n, spec["width"] // d
    q, k, v = (randn(b, n, h, d, dtype=dtype) for _ in range(3))
    refs = {i: reference_rows(q[i], k[i], v[i], causal=causal) for i in sorted({0, b - 1})}
    label = f"{str(dtype)[6:]} D={d} N={n} causal={causal}"
    qp, kp, vp = (x.view(b * n, h, d) for x in (q, k, v))
    cu = cu_seqlens_tensor([n] * b, device=device())
    dense_check = rows_checker(refs, dtype, lambda o, i: o[i])
    varlen_check = rows_checker(refs, dtype, lambda o, i: o[i * n:(i + 1) * n])

    def dense_call(mode=None):
        return lambda: pf.flash_attn_func(q, k, v, causal=causal, batch_invariant=mode)

    def varlen_call(mode=None):
        return lambda: pf.flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n,
                                                 max_seqlen_k=n, causal=causal, batch_invariant=mode)

    dense = measure(dense_call(), dense_check, label=f"dense {label}")
    varlen = measure(varlen_call(), varlen_check, label=f"varlen {label}")
    qt, kt, vt = map(bhsd, (q, k, v))
    sdpa_check = rows_checker(refs, dtype, lambda o, i: o[i].transpose(0, 1))
    flash = measure_sdpa("flash", qt, kt, vt, causal=causal, check=sdpa_check, label=f"SDPA flash {label}")
    cudnn = measure_sdpa("cudnn", qt, kt, vt, causal=causal, check=sdpa_check, label=f"SDPA cuDNN {label}")

    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    cases = {"dense": dense, "varlen": varlen, "flash": flash, "cudnn": cudnn}
    row = {"dtype": str(dtype)[6:], "D": d, "causal": causal, "N": n, "B": b, "H": h, "flops": flops}
    row.update({key: m.show(lambda ms: tflops(flops, ms)) for key, m in cases.items()})
    row.update({f"{key}_ms": m.ms for key, m in cases.items()})
    row.update({f"{key}_err": m.err for key, m in cases.items()})
    row.update(vs_flash=ratio(dense, flash), vs_cudnn=ratio(dense, cudnn), varlen_vs_dense=ratio(varlen, dense))
    if not invariant:
        return row, [dense, varlen]
    dense_on = measure(dense_call(True), dense_check, label=f"dense invariant {label}")
    varlen_on = measure(varlen_call(True), varlen_check, label=f"varlen invariant {label}")
    for key, off, on in (("dense", dense, dense_on), ("varlen", varlen, varlen_on)):
        row.update({f"{key}_inv": on.show(lambda ms: tflops(flops, ms)), f"{key}_inv_ms": on.ms,
                    f"{key}_inv_err": on.err, f"{key}_inv_x": invariant_x(off, on)})
    return row, [dense, varlen, dense_on, varlen_on]


INVARIANT_COLUMNS = {"dense_inv": "pf invariant", "dense_inv_x": "inv x", "varlen_inv": "pf varlen invariant",
                     "varlen_inv_x": "varlen inv x"}


def tflops_table(spec: dict, invariant: bool = False) -> tuple[Table, int]:
    table = Table(
        "tflops", f"Prefill TFLOP/s, B*N = {human(spec['tokens'])} tokens, Hq*D = {spec['width']} (Hq = Hkv)",
        {"dtype": "dtype", "D": "D", "causal": "causal", "N": "N", "dense": "pagedflash",
         "varlen": "pf varlen", "flash": "SDPA flash", "cudnn": "SDPA cuDNN", "vs_flash": "pf÷flash",
         "vs_cudnn": "pf÷cuDNN", "varlen_vs_dense": "varlen÷dense"},
        note="FLOPs = 4*B*Hq*N^2*D, halved for causal. Ratios: throughput, same run (>1: first faster). "
             "Every case checked against the fp32 reference (first and last 128 rows of the first and "
             "last sequence) before timing; FAIL = wrong result, not timed.",
    )
    if invariant:
        table.columns |= INVARIANT_COLUMNS
        table.note += " " + INVARIANT_NOTE
    cells = list(itertools.product(spec["dtypes"], spec["dims"], (False, True), spec["lens"]))
    bad = 0
    for dtype, d, causal, n in progress(cells, desc="prefill sweep"):
        row, ours = sweep_case(dtype, d, causal, n, spec, invariant)
        table.rows.append(row)
        bad += failures(ours)
        free_memory()
    return table, bad


def plot_tflops(table: Table, cfg: Config) -> None:
    panels = []
    for (dtype, d, causal), rows in itertools.groupby(table.rows, key=lambda r: (r["dtype"], r["D"], r["causal"])):
        rows = list(rows)
        panels.append({
            "title": f"{dtype} D={d} {'causal' if causal else 'non-causal'}", "xlabel": "N (B*N fixed)",
            "ylabel": "TFLOP/s",
            "series": {label: ([r["N"] for r in rows], [r[key] for r in rows]) for key, label in IMPLS.items()},
        })
    plot(cfg.out / "prefill_tflops.png", panels)


def main(cfg: Config) -> int:
    # with --batch-invariant the default side is the mode off, whatever the environment says
    with batch_invariant(False) if cfg.batch_invariant else contextlib.nullcontext():
        return _main(cfg)


def _main(cfg: Config) -> int:
    spec = QUICK if cfg.quick else FULL
    memory = memory_table(spec["memory"])
    print_table(memory)
    tput, bad = tflops_table(spec, cfg.batch_invariant)
    print_table(tput)
    summary = {
        "geomean_pf_vs_flash": geomean(r["vs_flash"] for r in tput.rows),
        "geomean_pf_vs_cudnn": geomean(r["vs_cudnn"] for r in tput.rows),
        "geomean_varlen_vs_dense": geomean(r["varlen_vs_dense"] for r in tput.rows),
        "failures": bad,
    }
    if cfg.batch_invariant:
        summary.update(geomean_invariant_x=geomean(r["dense_inv_x"] for r in tput.rows),
                       geomean_invariant_x_varlen=geomean(r["varlen_inv_x"] for r in tput.rows))
    print_summary(summary)
    plot_tflops(tput, cfg)
    path = write_results("prefill", [memory, tput], cfg.out, quick=cfg.quick, summary=summary)
    print(f"wrote {path} and {cfg.out / 'prefill_tflops.png'}")
    return 1 if bad else 0

"""Candidate launch tiles of the fused MoE layer (pagedflash/ops/moe.py, ``moe.Tiles``) against the
current choice (``moe.tiles()``), on the layers of ``pagedflash bench moe`` (a Qwen3-30B-A3B and a
GPT-OSS-20B layer, bf16) at T = 1, 4, 16, 64 and 8192 tokens.

Per case, the current tiles and each candidate are run once and checked against the fp32 reference
(a wrong or failing candidate is reported and skipped), then timed as ``pagedflash bench moe``
times (``bench.common.measure``: CUDA-graph replays, L2 zeroed before each call, or read with ``--flush
read``: left clean, as a decode step finds it; with ``--stack`` the decode sizes per layer of the bench's
stack of layers, each its own weights, back to back in one graph, as a decode step runs them). Candidates are
changes to the current tiles (labels name the changes):

- decode sizes (T <= 64): the fused sum (down GEMM and sum over k in one kernel), narrower column
  blocks, deeper reduction steps, stages and warps; at T <= 16 also the other grouping form and
  one-row matrix-vector products (``gemv``: no ``tl.dot``);
- T = 8192: per-pair partials in the input dtype (``part=dtype``) and prefill row, column and
  reduction blocks, warps, stages and program grouping, and whole blocks (no half tails: ``whole blocks``).

Printed: per case the current ms, the best candidate, their ratio and the issue's figures (current
tiles -> best): % of the bandwidth bound (``bench.moe.bound_ms``) and the per-expert PyTorch loop's
time over ours at decode sizes, a dense GEMM of the same FLOPs' time over ours at T = 8192 (issue
33's targets: >= 60 % at T = 1, >= 3x, >= 0.6x); then per regime (T = 1, T = 2..64, T > 64) each
variant's geometric-mean speedup over the current tiles, and the best tiles per case: what to put
into ``moe.tiles()``.

    python tools/tune_moe.py                 # the H200 run (about 4-6 minutes, --budget-s caps it)
    python tools/tune_moe.py --quick         # tiny shapes on the CPU interpreter (checks the script)
    python tools/tune_moe.py --compile-check # every candidate compiled for sm_90, no GPU (~2-4 min on a CPU)
"""
import argparse
import dataclasses
import math
import os
import sys
import time

if __name__ == "__main__" and "--compile-check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"  # before pagedflash: its kernels must be defined for the compiler

import torch

from pagedflash.bench import moe as bench_moe
from pagedflash.bench.common import free_memory, measure, ratio, set_timing, tflops
from pagedflash.bench.hbm import hbm_bandwidth
from pagedflash.ops import moe
from pagedflash.testing import check_close, compile_new, cubin_resources, recorded_launches

# (label, changes to the current tiles). Decode candidates keep the current rows per block; at T = 1
# the fused sum's down GEMM has H / bn2 programs (Qwen3: 64 at bn2 = 32), the unfused one k times as many
DECODE = [
    ("fused", dict(fused_sum=True)),
    ("fused bn13=16", dict(fused_sum=True, bn13=16)),
    ("fused bn13=16 bn2=16", dict(fused_sum=True, bn13=16, bn2=16)),
    ("fused bn13=16 bn2=16 bk=256", dict(fused_sum=True, bn13=16, bn2=16, bk=256)),
    ("fused bn13=16 bn2=16 stages=6", dict(fused_sum=True, bn13=16, bn2=16, stages=6)),
    ("fused bn13=16 bn2=16 warps=2", dict(fused_sum=True, bn13=16, bn2=16, warps=2)),
    ("fused bn13=16 bk=256", dict(fused_sum=True, bn13=16, bk=256)),
    ("fused bn13=16 bk=256 stages=3", dict(fused_sum=True, bn13=16, bk=256, stages=3)),
    ("fused bn13=16 bk=64 stages=6", dict(fused_sum=True, bn13=16, bk=64, stages=6)),
    ("fused bn2=64", dict(fused_sum=True, bn2=64)),
    ("fused bn13=64 bn2=64", dict(fused_sum=True, bn13=64, bn2=64)),
    ("bn13=16", dict(bn13=16)),
    ("bn13=16 bn2=16", dict(bn13=16, bn2=16)),
    ("bn13=16 bk=256", dict(bn13=16, bk=256)),
    ("bn13=16 bn2=64 bk=64 stages=5", dict(bn13=16, bn2=64, bk=64, stages=5)),
    ("bk=64 stages=5", dict(bk=64, stages=5)),
]
# at T <= 16: the other grouping form for the first few
OTHER_GROUPING = ("fused", "fused bn13=16", "bn13=16")
# at T <= 16: one-row matrix-vector products on the CUDA cores (direct, fused sum; pagedflash.ops.gemv's
# tiles: 8 rows of 512 per program, 4 warps, 3 stages, and neighbours)
_GEMV = dict(gemv=True, fused_sum=True, direct=True, bm=1, group_m=1, warps=4)
GEMV = [
    ("gemv bn=8 bk=512", dict(_GEMV, bn13=8, bn2=8, bk=512, stages=3)),
    ("gemv bn=8 bk=256 stages=4", dict(_GEMV, bn13=8, bn2=8, bk=256, stages=4)),
    ("gemv bn13=16 bn2=8 bk=256", dict(_GEMV, bn13=16, bn2=8, bk=256, stages=3)),
    ("gemv bn=4 bk=512", dict(_GEMV, bn13=4, bn2=4, bk=512, stages=3)),
    ("gemv bn=8 bk=512 warps=8", dict(_GEMV, bn13=8, bn2=8, bk=512, stages=3, warps=8)),
    # [bk, bn] accumulators reduced along K once after the loop, in both GEMMs (moe.Tiles.wide)
    ("gemv wide bn=8 bk=512", dict(_GEMV, bn13=8, bn2=8, bk=512, stages=3, wide=True)),
    ("gemv wide bn13=4 bn2=8 bk=1024", dict(_GEMV, bn13=4, bn2=8, bk=1024, stages=3, wide=True)),
    ("gemv wide bn13=4 bn2=4 bk=1024", dict(_GEMV, bn13=4, bn2=4, bk=1024, stages=3, wide=True)),
    ("gemv wide bn13=4 bn2=2 bk=1024", dict(_GEMV, bn13=4, bn2=2, bk=1024, stages=3, wide=True)),
    ("gemv wide bn13=4 bn2=4 bk=512 stages=4", dict(_GEMV, bn13=4, bn2=4, bk=512, stages=4, wide=True)),
    ("gemv wide bn13=4 bn2=4 bk=1024 warps=8", dict(_GEMV, bn13=4, bn2=4, bk=1024, stages=3, warps=8, wide=True)),
    ("gemv wide bn13=16 bn2=8 bk=256", dict(_GEMV, bn13=16, bn2=8, bk=256, stages=3, wide=True)),
    ("gemv wide bn13=16 bn2=4 bk=256 stages=4", dict(_GEMV, bn13=16, bn2=4, bk=256, stages=4, wide=True)),
    ("gemv wide bn13=2 bn2=8 bk=1024", dict(_GEMV, bn13=2, bn2=8, bk=1024, stages=3, wide=True)),
    ("gemv wide bn13=4 bn2=8 bk=1024 warps=2", dict(_GEMV, bn13=4, bn2=8, bk=1024, stages=3, warps=2, wide=True)),
    ("gemv wide bn13=4 bn2=8 bk=1024 stages=2", dict(_GEMV, bn13=4, bn2=8, bk=1024, stages=2, wide=True)),
    ("gemv wide bn13=4 bn2=16 bk=512", dict(_GEMV, bn13=4, bn2=16, bk=512, stages=3, wide=True)),
    # the down-and-sum kernel as gate/up's programmatic dependent (sm90+), then also its weights asked in L2
    ("gemv wide bn13=4 bn2=8 bk=1024 pdl", dict(_GEMV, bn13=4, bn2=8, bk=1024, stages=3, wide=True, pdl=1)),
    ("gemv wide bn13=4 bn2=8 bk=1024 pdl+L2", dict(_GEMV, bn13=4, bn2=8, bk=1024, stages=3, wide=True, pdl=2)),
]
PREFILL = [
    ("part=dtype", dict(part_fp32=False)),
    ("part=dtype stages=3", dict(part_fp32=False, stages=3)),
    ("stages=3", dict(stages=3)),
    ("part=dtype bn13=128", dict(part_fp32=False, bn13=128)),
    ("part=dtype bn2=256", dict(part_fp32=False, bn2=256)),
    ("part=dtype bn13=128 bn2=256", dict(part_fp32=False, bn13=128, bn2=256)),
    ("part=dtype bk=32 stages=5", dict(part_fp32=False, bk=32, stages=5)),
    ("part=dtype bk=128 stages=2", dict(part_fp32=False, bk=128, stages=2)),
    ("part=dtype warps=4", dict(part_fp32=False, warps=4)),
    ("part=dtype bm=64 warps=4", dict(part_fp32=False, bm=64, warps=4)),
    ("part=dtype bm=64 bn13=128 warps=4 stages=4", dict(part_fp32=False, bm=64, bn13=128, warps=4, stages=4)),
    ("part=dtype group_m=16", dict(part_fp32=False, group_m=16)),
    ("part=dtype group_m=1", dict(part_fp32=False, group_m=1)),
    # back toward the earlier prefill tiles (fp32 partials, 64 + 64 / 128 columns), against the current ones
    ("part=fp32", dict(part_fp32=True)),
    ("bn13=64 bn2=128", dict(bn13=64, bn2=128)),
    # whole blocks: every expert's run padded to the 128-row block, no half-height tail tile
    ("whole blocks", dict(half=False)),
    ("half group_m=1", dict(half=True, group_m=1)),
]


def candidates(current: moe.Tiles, T: int, k: int, E: int, decode: bool, quick: bool,
               labels: list[str] | None = None) -> list[tuple[str, moe.Tiles]]:
    """The labelled candidate tiles of one case (each distinct from the current tiles; only those
    named in ``labels`` if given)."""
    # decode changes apply to the tensor-core tiles, also where the current ones are the gemv form
    # (with the grouping tiles() gives the tensor-core sizes: direct for one token or few pairs)
    base = moe.decode_tiles(T == 1 or T * k * 4 <= E) if current.gemv else current
    found = [("tensor cores", base)] if current.gemv else []
    for label, changes in (DECODE + (GEMV if T <= 16 else [])) if decode else PREFILL:
        found.append((label, base._replace(**changes)))
        if decode and 1 < T <= 16 and label in OTHER_GROUPING:
            other = "direct" if not current.direct else "sorted"
            found.append((f"{label} {other}", base._replace(direct=not current.direct, **changes)))
    # of the labels asked for, each tile once, under its first label (the current tiles drop)
    seen = {current}
    found = [(label, t) for label, t in found
             if (labels is None or label in labels) and t not in seen and not seen.add(t)]
    if quick:  # the first candidate and the first matrix-vector one (or the second)
        return found[:1] + ([c for c in found if c[1].gemv] or found[1:])[:1]
    return found


def regime(T: int, decode_max: int) -> str:
    """The case's group in the per-regime geomeans: one token, the rest of the gemv tiles' sizes,
    the tensor-core decode sizes, prefill."""
    g = moe.GEMV_MAX_TOKENS
    if T == 1:
        return "T=1"
    if T <= g:
        return f"T=2..{g}"
    return f"T={g + 1}..{decode_max}" if T <= decode_max else f"T>{decode_max}"


def run_case(name: str, T: int, spec: dict, quick: bool, deadline: float, speedups: dict,
             labels: list[str] | None = None, stack: bool = False) -> dict:
    """Time the current tiles and the candidates on one case; record each candidate's speedup over the
    current tiles in ``speedups[(regime, label)]``; return the case's summary row. ``stack``: decode
    sizes timed per layer of ``bench.moe``'s stack (its layers back to back in one graph)."""
    c = bench_moe.inputs(name, T, spec)
    decode = T <= spec["decode_max"]
    layers, stacked = bench_moe.STACK, None
    if stack and decode:  # the weight copies made once a case
        try:
            stacked = bench_moe.stack_fn(c, layers)
        except torch.OutOfMemoryError:
            free_memory()
            print(f"{name} T={T}: the stack's weight copies do not fit: timed as single calls", flush=True)
    current = moe.tiles(T, c["k"], c["E"])

    def check(got):
        return check_close(got, c["want"], spec["dtype"])

    def timed(tiles: moe.Tiles | None, label: str):
        moe.TILES = tiles
        try:
            if stacked is None:
                return measure(bench_moe.ours_fn(c), check, label=f"{name} T={T} {label}")
            got = measure(stacked, check, label=f"{name} T={T} {label} in a stack", flush=None)
            return got if not got.ok else dataclasses.replace(got, ms=got.ms / layers)
        finally:
            moe.TILES = None

    bound = bench_moe.bound_ms(c["weights"], c["topk_ids"], c["hidden"]) if decode else None

    def figure(ms: float) -> str:
        if bound is not None:
            return f"{100 * bound / ms:5.1f} % of bound"
        return f"{tflops(bench_moe.flops(c), ms):6.1f} TFLOP/s"

    base = timed(None, "current")
    row = dict(shape=name, T=T, current=current, current_ms=base.ms, best=None, best_label="current",
               best_ms=base.ms, bound_ms=bound, loop_ms=None, dense_ms=None)
    if not base.ok:
        print(f"{name} T={T}: current tiles {base.status} ({base.note or 'wrong result'}); candidates skipped",
              flush=True)
        return row
    if decode:  # the comparisons: a per-expert loop of PyTorch matmuls, a dense GEMM
        loop = measure(bench_moe.loop_baseline(c["hidden"], topk_weights=c["topk_weights"], topk_ids=c["topk_ids"],
                                               activation=c["activation"], **c["weights"]),
                       check, label=f"loop {name} T={T}")
        row["loop_ms"], extra = loop.ms, f", loop {loop.ms:.4f} ms, loop÷ours {ratio(base, loop):.2f}" if loop.ok else ""
    else:
        dense = measure(bench_moe.dense_fn(c), label=f"dense GEMM {name} T={T}")
        row["dense_ms"], extra = dense.ms, f", dense GEMM {dense.ms:.4f} ms, ours÷dense {ratio(base, dense):.3f}" if dense.ok else ""
    print(f"{name} T={T}: current {current} {base.ms:.4f} ms, {figure(base.ms)}{extra}", flush=True)
    for label, tiles in candidates(current, T, c["k"], c["E"], decode, quick, labels):
        if time.monotonic() > deadline:
            print(f"  budget spent: the remaining candidates of {name} T={T} are not timed", flush=True)
            break
        got = timed(tiles, label)
        if not got.ok:
            print(f"  {label:40s} {got.status}: {(got.note or 'wrong result')[:100]} (skipped)", flush=True)
            continue
        speedup = base.ms / got.ms
        speedups.setdefault((regime(T, spec["decode_max"]), label), []).append(speedup)
        print(f"  {label:40s} {got.ms:.4f} ms  x{speedup:.3f}  {figure(got.ms)}", flush=True)
        if got.ms < row["best_ms"]:
            row.update(best=tiles, best_label=label, best_ms=got.ms)
    return row


def _change(row: dict, other_ms: float | None, scale: float = 1.0) -> str:
    """``scale * other_ms / ours``, the current tiles' then the best's ("-": not measured)."""
    if other_ms is None:
        return "-"
    return f"{scale * other_ms / row['current_ms']:.2f} → {scale * other_ms / row['best_ms']:.2f}"


def report(rows: list[dict], speedups: dict, spec: dict, stack: bool = False) -> None:
    print("\n| shape | T | current ms | best | best ms | current÷best | % of bound | loop÷ours | ours÷dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["current_ms"] is None:
            print(f"| {r['shape']} | {r['T']} | FAIL | - | - | - | - | - | - |")
            continue

        figures = [_change(r, r["bound_ms"], 100), _change(r, r["loop_ms"]), _change(r, r["dense_ms"])]
        print(f"| {r['shape']} | {r['T']} | {r['current_ms']:.4f} | {r['best_label']} | {r['best_ms']:.4f} | "
              f"{r['current_ms'] / r['best_ms']:.3f} | {' | '.join(figures)} |")
    print(f"\n% of bound: the picked experts' bytes at {hbm_bandwidth()}")
    if stack:
        print(f"--stack: ours at decode sizes per layer of a stack of {bench_moe.STACK} (loop÷ours: the loop timed alone)")
    print("\nPer regime, variants by geometric-mean speedup over the current tiles (cases timed / cases):")
    cases = {}
    for r in rows:
        reg = regime(r["T"], spec["decode_max"])
        cases[reg] = cases.get(reg, 0) + 1
    for reg in cases:
        ranked = sorted(((math.prod(v) ** (1 / len(v)), len(v), label) for (g, label), v in speedups.items()
                         if g == reg), reverse=True)
        print(f"  {reg}:")
        for score, n, label in ranked[:5]:
            print(f"    {label:40s} x{score:.3f}  ({n}/{cases[reg]})")
    print("\nSuggested tiles() per case (the best measured; 'current' where no candidate beat it):")
    for r in rows:
        print(f"  {r['shape']} T={r['T']}: {r['best'] or r['current']}")


def compile_check(shapes: list[str], tokens: list[int], labels: list[str] | None) -> int:
    """Compile the current tiles' and every candidate's kernels for sm_90 (bf16, the real layer shapes,
    weights as zero-stride views: nothing is allocated but the activations) and print each distinct
    kernel's registers, spills, shared memory and whether its loop is pipelined (asynchronous copies): what the H200 run
    would compile, checked on any machine. Returns the number of kernels that failed to compile."""
    spec, seen, failed = bench_moe.FULL, set(), 0
    for name in shapes:
        h, i, E, k, activation = spec["shapes"][name]
        one = bench_moe.layer(h, i, 1, activation, spec["dtype"], "cpu")
        weights = {n: w.expand((E,) + tuple(w.shape[1:])) for n, w in one.items()}
        for T in tokens:
            current = moe.tiles(T, k, E)
            found = [("current", current)] + candidates(current, T, k, E, T <= spec["decode_max"], False, labels)
            for label, tiles in found:
                x = torch.empty(T, h, dtype=spec["dtype"])
                topk_weights, topk_ids = torch.full((T, k), 1 / k), torch.arange(T * k, dtype=torch.int32).view(T, k) % E
                moe.TILES = tiles
                try:
                    with recorded_launches() as calls:
                        moe.fused_moe(x, topk_weights=topk_weights, topk_ids=topk_ids, activation=activation, **weights)
                finally:
                    moe.TILES = None
                for launch, ck, error, seconds in compile_new(calls, seen):
                    if error is not None:
                        failed += 1
                        print(f"{name} T={T} {label}: {launch.kernel.__name__} FAILED {type(error).__name__}: "
                              f"{str(error)[:300]}", flush=True)
                        continue
                    copies = ck.asm["ttgir"].count("async_copy_global_to_local")  # none: loads not pipelined
                    usage = cubin_resources(ck.asm["cubin"])
                    print(f"{name} T={T} {label:40s} {launch.kernel.__name__:17s} {usage['REG']:3d} regs, "
                          f"{usage['LOCAL']:3d} B local (spills), smem {ck.metadata.shared:6d} B, "
                          f"{copies:2d} async copies, {seconds:.1f} s", flush=True)
    print(f"{len(seen)} kernels, {failed} failed")
    return failed


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU interpreter, 2 candidates a case")
    parser.add_argument("--shapes", nargs="*", help="a subset of the shapes (default: all)")
    parser.add_argument("--tokens", nargs="*", type=int, help="a subset of the token counts (default: all)")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="stop timing candidates after this many seconds (the summary still prints)")
    parser.add_argument("--compile-check", action="store_true",
                        help="no timing, no GPU: compile every candidate's kernels for sm_90 and print their registers, "
                             "spills, shared memory and whether their loops are pipelined (run as a script)")
    parser.add_argument("--labels", nargs="*", help="only the candidates of these labels (as printed; none: only "
                                                    "the current tiles)")
    parser.add_argument("--stack", action="store_true",
                        help="ours at decode sizes timed per layer in bench moe's stack of layers (each its own "
                             "weights, back to back in one CUDA graph, as a decode step runs them); --flush then "
                             "applies to the per-expert loop and the prefill sizes")
    parser.add_argument("--flush", choices=("zero", "read"), default="zero",
                        help="L2 before each timed call, as `pagedflash bench --flush`: zeroed (left dirty) or read")
    args = parser.parse_args(argv)
    set_timing(flush=args.flush)
    spec = bench_moe.QUICK if args.quick else bench_moe.FULL
    shapes = args.shapes or list(spec["shapes"])
    unknown = [s for s in shapes if s not in spec["shapes"]]
    if unknown:
        parser.error(f"--shapes: expected names from {sorted(spec['shapes'])}, got {unknown}")
    tokens = args.tokens or list(spec["tokens"])
    if args.compile_check:
        if os.environ.get("TRITON_INTERPRET") != "0":
            parser.error("--compile-check: run tools/tune_moe.py as a script (the kernels must not be interpreted)")
        return 1 if compile_check(shapes, tokens, args.labels) else 0
    ends = (min(tokens), max(tokens))
    tokens = sorted(tokens, key=lambda T: (T not in ends, T))  # the smallest and largest first
    start = time.monotonic()
    deadline = start + args.budget_s
    rows, speedups = [], {}
    for T in tokens:  # should the budget run out, T = 1 and the prefill size are timed on every shape
        for name in shapes:
            rows.append(run_case(name, T, spec, args.quick, deadline, speedups, args.labels, args.stack))
            free_memory()
    report(sorted(rows, key=lambda r: (shapes.index(r["shape"]), r["T"])), speedups, spec, args.stack)
    print(f"\n{time.monotonic() - start:.0f} s")
    return 1 if any(r["current_ms"] is None for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

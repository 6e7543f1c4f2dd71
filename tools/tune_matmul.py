"""The batch-invariant GEMM (pagedflash/ops/matmul.py) against cuBLAS (F.linear) on Llama-3-8B's
projections at M = 1, 32, 256, 8192 rows, bf16, in the same run; and whether each keeps a row's bits
when M changes (ours must; cuBLAS picks its kernel by M).

Each case cycles through enough copies of its weight (> 2x L2) inside one CUDA graph, as the layers
of a model do, so weights come from HBM. ``--sweep`` also times candidate tiles: one tile serves
every M (the invariance), so a shape's best tile is the one with the best geometric mean of
cuBLAS ÷ ours over the M values.   python tools/tune_matmul.py [--sweep] [--chunk-k]
``--chunk-k``: also the default tile with K in fixed chunks (``matmul.CHUNK_K``: more programs at small
M where the column tiles leave SMs idle), its times and its own invariance check in the same run.
``--smoke``: tiny shapes on the CPU interpreter (checks the script; its times mean nothing, and
its invariance flag is the interpreter's: numpy's matmul is not row-invariant, tests/test_matmul.py).
"""
import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from pagedflash.bench.common import time_ms
from pagedflash.ops import matmul as mm

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 32, 256, 8192)
SWEEP = [mm.Tile(64, bn, bk, w, st, 8)
         for bn, bk, w, st in itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4, 5)) if bn * bk <= 16384]


def graph_us(fn, calls: int) -> float:
    """Mean µs per call of ``fn(i)`` for i in range(calls), captured in one CUDA graph and replayed
    back to back (the calls stream their own weight copies)."""
    return time_ms(lambda: [fn(i) for i in range(calls)], graph=True, flush=None, reps=5) * 1e3 / calls


def invariant(linear, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Rows 0, 1 and the last of ``linear(x)`` bitwise equal to the same rows computed alone and in a
    batch of 32."""
    full = linear(x, w)
    rows = (0, 1, x.shape[0] - 1)
    alone = all(torch.equal(linear(x[i:i + 1], w)[0], full[i]) for i in rows)
    batch = linear(torch.cat([x[list(rows)], x[:32 - len(rows)]]), w)
    return alone and all(torch.equal(batch[j], full[i]) for j, i in enumerate(rows))


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time the candidate tiles")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the interpreter)")
    parser.add_argument("--chunk-k", action="store_true", help="also the default tile with K in fixed chunks")
    args = parser.parse_args()
    dev, dt = ("cpu", torch.float16) if args.smoke else ("cuda", torch.bfloat16)
    shapes = {"tiny": (48, 40)} if args.smoke else SHAPES
    rows = (1, 3, 70) if args.smoke else ROWS
    for name, (n, k) in shapes.items():
        copies = 2 if args.smoke else max(2, -(-300_000_000 // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
        x_all = torch.randn(max(rows), k, device=dev, dtype=dt)
        flags = {label: invariant(fn, x_all, weights[0]) for label, fn in (("ours", mm.matmul), ("cuBLAS", F.linear))}
        print(f"{name}: N={n} K={k} tile {mm.tile(n, k, dt, x_all.device)}; bitwise row invariance (M=1, 32, "
              f"{max(rows)}): ours {flags['ours']}, cuBLAS {flags['cuBLAS']}", flush=True)
        tiles = [None] + (SWEEP if args.sweep else [])
        if args.chunk_k:
            mm.CHUNK_K = True
            chunked = mm.tile(n, k, dt, x_all.device)
            mm.CHUNK_K = False
            if chunked.chunk_k:
                mm.TILE = chunked
                flag = invariant(mm.matmul, x_all, weights[0])
                mm.TILE = None
                print(f"  chunked: {chunked}; bitwise row invariance {flag}", flush=True)
                tiles.append(chunked)
            else:
                print("  chunked: no chunks for this shape (its column tiles fill the SMs)", flush=True)
        results = {}  # tile -> [cuBLAS / ours per M]
        for m in rows:
            x = x_all[:m]
            calls = max(2, copies)
            base = graph_us(lambda i, x=x, ws=weights, c=copies: F.linear(x, ws[i % c]), calls)
            for t in tiles:
                mm.TILE = t
                try:
                    ours = graph_us(lambda i, x=x, ws=weights, c=copies: mm.matmul(x, ws[i % c]), calls)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                    print(f"  M={m} {t}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                    results[t] = None
                    continue
                finally:
                    mm.TILE = None
                if results.get(t, []) is not None:
                    results.setdefault(t, []).append(base / ours)
                if t is None or (args.chunk_k and t.chunk_k):
                    tflops, tbs = 2 * m * n * k / ours / 1e6, (n * k + m * (n + k)) * 2 / ours / 1e6
                    label = "chunked" if t is not None else "ours"
                    print(f"  M={m:5d}: cuBLAS {base:9.2f} us  {label} {ours:9.2f} us  ({tflops:6.1f} TFLOP/s, "
                          f"{tbs:5.2f} TB/s)  cuBLAS/{label} {base / ours:.2f}", flush=True)
        if args.sweep or args.chunk_k:
            ranked = sorted(((math.prod(r) ** (1 / len(r)), t) for t, r in results.items() if t is not None and r),
                            key=lambda e: -e[0])
            for score, t in ranked[:6]:
                print(f"  {t}: geomean cuBLAS/ours {score:.3f}  per M {[f'{v:.2f}' for v in results[t]]}", flush=True)
        del weights


if __name__ == "__main__":
    main()

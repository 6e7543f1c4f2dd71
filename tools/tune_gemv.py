"""Tile sweep of the single-row projections (pagedflash/ops/gemv.py) on the 1B engine's shapes,
against cuBLAS (F.linear, plus the separate norm / SiLU kernel it needs) in the same run.

Each case cycles through enough copies of its weight (> 2x L2) inside one CUDA graph, as the layers
of a model do, so weights come from HBM.   python tools/tune_gemv.py
"""
import itertools

import torch
import torch.nn.functional as F

from pagedflash.bench.common import time_ms
from pagedflash.ops import activation, gemv, norm

H, I, QKV, V = 2048, 8192, 3072, 128256
CASES = [  # name, (n, k), prologue
    ("qkv (norm)", (QKV, H), gemv.RMS_NORM),
    ("o_proj", (H, H), gemv.PLAIN),
    ("gate_up (norm+res)", (2 * I, H), gemv.RMS_NORM),
    ("down (silu)", (H, I), gemv.SILU_MUL),
    ("lm_head (norm+res)", (V, H), gemv.RMS_NORM),
]
CONFIGS = [(bn, bk, 4, st) for bn, bk, st in itertools.product((4, 8, 16, 32), (128, 256, 512), (3, 4))] + [
    (bn, bk, w, st) for bn, bk, w, st in itertools.product((2, 4, 8), (1024, 2048), (4, 8), (1, 2))]  # short loops


def graph_us(fn, calls: int, reps: int = 5) -> float:
    """Mean µs per call of ``fn(i)`` for i in range(calls), captured in one CUDA graph and replayed
    back to back (no flush: the calls stream their own weight copies)."""
    return time_ms(lambda: [fn(i) for i in range(calls)], graph=True, flush=None, reps=reps) * 1e3 / calls


@torch.inference_mode()
def main() -> None:
    dt = torch.bfloat16
    for name, (n, k), prologue in CASES:
        copies = max(2, -(-300_000_000 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=dt) / k**0.5 for _ in range(copies)]
        norm_w = torch.randn(k, device="cuda", dtype=dt)
        x = torch.randn(1, 2 * k if prologue == gemv.SILU_MUL else k, device="cuda", dtype=dt)
        res = torch.randn(1, k, device="cuda", dtype=dt) if prologue == gemv.RMS_NORM and n != QKV else None
        calls = 2 * copies if copies < 20 else copies

        def ours(i, weights=weights, copies=copies, prologue=prologue, x=x, res=res, norm_w=norm_w):
            w = weights[i % copies]
            if prologue == gemv.RMS_NORM:
                return gemv.rms_norm_gemv(x, w, norm_weight=norm_w, eps=1e-5, residual=res)[0]
            if prologue == gemv.SILU_MUL:
                return gemv.silu_mul_gemv(x, w)
            return gemv.gemv(x, w)

        def cublas(i, weights=weights, copies=copies, prologue=prologue, x=x, res=res, norm_w=norm_w):
            w = weights[i % copies]
            if prologue == gemv.RMS_NORM:
                return F.linear(norm.rms_norm(x, norm_w, 1e-5, res)[0], w)
            if prologue == gemv.SILU_MUL:
                return F.linear(activation.silu_mul(x), w)
            return F.linear(x, w)

        gemv.TILE = None
        default = graph_us(ours, calls)
        base = graph_us(cublas, calls)
        mb = n * k * 2 / 1e6
        print(f"{name}: {n}x{k} ({mb:.1f} MB)  cuBLAS+prologue {base:.2f} us ({mb / base:.2f} TB/s); "
              f"gemv.tile {gemv.tile(n, k)} {default:.2f} us ({mb / default:.2f} TB/s, x{base / default:.2f})", flush=True)
        want = cublas(0)
        rows = []
        for bn, bk, warps, stages in CONFIGS:
            gemv.TILE = (bn, bk, warps, stages)
            try:
                err = ours(0).float().sub(want.float()).abs().max().item()
                t = graph_us(ours, calls)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                print(f"  bn={bn} bk={bk} w={warps} s={stages}: failed {type(e).__name__}", flush=True)
                continue
            rows.append((t, bn, bk, warps, stages, err))
        for t, bn, bk, warps, stages, err in sorted(rows)[:6]:
            print(f"  bn={bn:3d} bk={bk:4d} w={warps} s={stages}: {t:7.2f} us  {mb / t:.2f} TB/s  "
                  f"x{base / t:.2f} vs cuBLAS  max|diff| {err:.3g}", flush=True)
        del weights


if __name__ == "__main__":
    main()

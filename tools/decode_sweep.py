"""Decode time by tile, pipeline depth and split count over the serving grid's split cells and the
seed's sweep: the evidence behind ``choose_config``'s decode rows and ``choose_num_splits``.
Prints, per cell, µs for every (tile, split count), SDPA cuDNN timed the same way, the kernel's
registers and shared memory, and the floor of an empty launch under both L2 flushes.

    PYTHONPATH=. python tools/decode_sweep.py [--cells 64x1024,64x4096] [--splits 1,2]

Timing as ``bench decode``: do_bench (L2 zeroed before every call) of a CUDA-graph replay;
``time_us(.., "read")`` flushes by reading instead (L2 left clean: no write-back in the timed call).
"""
import argparse
import sys
from functools import partial

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from pagedflash import validate
from pagedflash.bench.common import graphed
from pagedflash.ops.attention import attention_forward
from pagedflash.ops.launch import LaunchConfig

# (B, N, Hq, Hkv, D, dtype): the serving grid's split cells (B <= 16) and the seed's sweep
CELLS = [(b, n, 32, 8, 128, torch.bfloat16) for b in (1, 4, 16) for n in (1024, 4096, 16384, 65536, 131072)]
CELLS += [(4, n, 16, 16, 64, torch.float16) for n in (1024, 2048, 4096, 8192, 16384)]
CONFIGS = [(128, 4, 2, True), (64, 4, 3, False), (32, 4, 4, False), (64, 4, 2, True), (64, 4, 4, True)]  # (bn, warps, stages, tma)
SPLITS = [1, 2, 4, 8, 16, 32, 64]


@triton.jit
def _empty(X):
    tl.store(X, 1.0)


_FLUSH = {}


def time_us(fn, flush="zero") -> float:
    """Median µs of graph replays of ``fn``, L2 flushed before each: ``zero`` writes a 256 MB buffer
    (do_bench's way: L2 is left full of dirty lines the timed call must write back), ``read`` reads it
    (L2 left full of clean lines)."""
    replay = graphed(fn) or fn
    if flush == "zero":
        return do_bench(replay, warmup=10, rep=30, return_mode="median") * 1e3
    if not _FLUSH:
        _FLUSH["buf"] = torch.ones(64 * 2**20, device="cuda")
        _FLUSH["out"] = torch.empty((), device="cuda")
    buf, out = _FLUSH["buf"], _FLUSH["out"]
    times = []
    for i in range(60):
        torch.sum(buf, dim=0, out=out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        if i >= 10:
            times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def sweep_cell(b, n, hq, hkv, d, dtype, sms) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype)
    kc, vc = (torch.randn(b, n, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    gb = 2 * b * n * hkv * d * kc.element_size() / 1e9
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cu = time_us(partial(F.scaled_dot_product_attention, q.transpose(1, 2), kc.transpose(1, 2),
                             vc.transpose(1, 2), enable_gqa=True))
    print(f"B={b} N={n} {hq}/{hkv} D={d} ({gb:.3f} GB, {b * hkv} KV heads, {sms} SMs): cuDNN {cu:.1f} us; "
          f"splits {SPLITS} then auto", flush=True)
    for bn, w, st, tma in CONFIGS:
        cfg = LaunchConfig(block_m=max(16, hq // hkv), block_n=bn, g_pack=hq // hkv, num_warps=w, num_stages=st,
                           tma=tma)
        times = []
        for splits in SPLITS + [0]:
            if splits > 1 and n // splits < bn:
                times.append(float("nan"))
                continue
            call = partial(attention_forward, q, kc, vc, batch=b, max_seqlen_q=1, max_seqlen_k=n, sm_scale=d**-0.5,
                           window=(-1, 0), softcap=0.0, seqused_k=lens, num_splits=splits, config=cfg)
            try:
                call()
                times.append(time_us(call))
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg} splits={splits}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                times.append(float("nan"))
        ok = [t for t in times if t == t]
        best = min(ok) if ok else float("nan")
        cells = " ".join(f"{t:6.1f}{'*' if t == best else ' '}" for t in times)
        print(f"  bn={bn:3d} w={w} s={st} tma={tma!s:5}: {cells}  best/cuDNN {cu / best:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", help="BxN[,BxN...] of the serving grid's shape (default: every split cell "
                                        "and the seed's sweep)")
    parser.add_argument("--splits", help="split counts to time, comma-separated (default: %(default)s)",
                        default=",".join(map(str, SPLITS)))
    args = parser.parse_args()
    cells = CELLS
    if args.cells:
        cells = [(*map(int, c.split("x")), 32, 8, 128, torch.bfloat16) for c in args.cells.split(",")]
    SPLITS[:] = [int(x) for x in args.splits.split(",")]
    validate.value_checks(False).__enter__()
    x = torch.zeros(1, device="cuda")
    for flush in ("zero", "read"):
        print(f"floor ({flush} flush): empty kernel {time_us(lambda: _empty[(1,)](x), flush):.1f} us", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cell in cells:
        sweep_cell(*cell, sms)
    return 0


if __name__ == "__main__":
    sys.exit(main())

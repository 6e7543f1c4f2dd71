"""What each decode call launches, as CUPTI sees it: kernel names, grid and block shapes, registers,
shared memory, occupancy and mean GPU time, for pagedflash and SDPA (cuDNN, flash) on serving cells.
The L2 is flushed (zeroed) before every call, as in `bench decode`, so both read K/V from HBM.
    python tools/profile_kernels.py [BxN ...]        (default: the short serving cells)
    python tools/profile_kernels.py --moe [T ...]    (default 1 4: the fused MoE layer of `bench moe`'s
                                                     shapes, each kernel's time beside the bandwidth bound)"""
import collections
import json
import os
import sys
import tempfile
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from pagedflash import flash_attn_with_kvcache, validate

HQ, HKV, D, CALLS = 32, 8, 128, 30
FIELDS = ["grid", "block", "registers per thread", "shared memory", "blocks per SM", "est. achieved occupancy %"]


def kernels(fn, flush: torch.Tensor) -> list[tuple[str, float, dict]]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    by_name = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel" and "zero" not in e["name"].lower() and "fill" not in e["name"].lower():
            by_name[e["name"]].append(e)
    return [(name, sum(e["dur"] for e in es) / len(es), es[0]["args"]) for name, es in by_name.items()]


def print_kernels(label: str, ks) -> None:
    total = sum(us for _, us, _ in ks)
    print(f"  {label}: {total:.1f} us of kernels")
    for name, us, args in ks:
        info = " ".join(f"{k.split()[0]}={args.get(k)}" for k in FIELDS if k in args)
        print(f"    {us:7.1f} us  {name[:90]}  {info}")


def main_moe(argv: list[str]) -> None:
    """The fused MoE layer (``bench moe``'s inputs and call) at T tokens: where its time goes against the
    picked experts' bandwidth bound."""
    from pagedflash.bench import moe as bench_moe

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for name in bench_moe.SHAPES:
        for T in [int(t) for t in argv] or [1, 4]:
            case = bench_moe.inputs(name, T, bench_moe.FULL)
            bound_us = 1e3 * bench_moe.bound_ms(case["weights"], case["topk_ids"], case["hidden"])
            print(f"== {name} T={T}: bound {bound_us:.1f} us "
                  f"({bench_moe.active_bytes(case['weights'], case['topk_ids'], case['hidden']) / 1e6:.1f} MB)")
            print_kernels("pagedflash fused_moe", kernels(bench_moe.ours_fn(case), flush))
            sys.stdout.flush()


def main(argv: list[str]) -> None:
    if argv[:1] == ["--moe"]:
        return main_moe(argv[1:])
    cells = [tuple(int(x) for x in c.split("x")) for c in argv] or [(1, 1024), (4, 1024), (16, 1024), (16, 4096),
                                                                     (64, 1024), (1, 16384)]
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    validate.value_checks(False).__enter__()
    for b, n in cells:
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, n, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        sdpa = partial(F.scaled_dot_product_attention, q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                       enable_gqa=True)
        print(f"== B={b} N={n} (K+V {2 * b * n * HKV * D * 2 / 1e6:.0f} MB)", flush=True)
        for label, fn, backend in [("pagedflash", partial(flash_attn_with_kvcache, q, kc, vc, cache_seqlens=lens), None),
                                   ("pagedflash no-lens", partial(flash_attn_with_kvcache, q, kc, vc), None),
                                   ("cudnn", sdpa, SDPBackend.CUDNN_ATTENTION),
                                   ("flash", sdpa, SDPBackend.FLASH_ATTENTION)]:
            if backend is None:
                ks = kernels(fn, flush)
            else:
                with sdpa_kernel(backend):
                    ks = kernels(fn, flush)
            print_kernels(label, ks)
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])

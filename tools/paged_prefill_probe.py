"""Chunked prefill over a page pool vs dense (B=1, 512 new tokens over a cached prefix, Hq/Hkv = 32/8,
D=128, bf16), per tile, with the pipelining Triton gave each compiled variant:
    TRITON_KERNEL_DUMP=1 TRITON_DUMP_DIR=dump python tools/paged_prefill_probe.py [cached ...]
then `--ir dump` counts, per dumped attention kernel, its asynchronous copies (pipelined loads) and
its synchronous 2-D loads. Public-ish internals only (attention_forward), so two checkouts can be
compared by PYTHONPATH."""
import glob
import re
import sys
from functools import partial

import torch

from pagedflash import flash_attn_func
from pagedflash.bench.decode import permuted_table, to_pool
from pagedflash.bench.tune import _time_us
from pagedflash.ops.attention import attention_forward
from pagedflash.ops.launch import LaunchConfig

HQ, HKV, D, NEW = 32, 8, 128, 512
TILES = {0: [(64, 64, 4, 3, False), (128, 128, 8, 3, False), (128, 128, 8, 3, True)],
         16: [(64, 64, 4, 3, False), (128, 128, 8, 3, False), (64, 16, 4, 3, False), (64, 16, 4, 3, True),
              (64, 16, 4, 4, True), (128, 16, 8, 3, True), (128, 16, 4, 3, True), (128, 16, 8, 4, True)],
         64: [(64, 64, 4, 3, False), (64, 64, 4, 3, True), (128, 64, 8, 3, False)]}


def chunked_case(cached: int):
    """B=1, NEW new tokens over ``cached`` ones: q, k, v (dense, bf16), the key count, the FLOPs, the
    library's dense time and output ``[NEW, Hq, D]`` fp32, and the varlen offsets of q and k."""
    n = cached + NEW
    q = torch.randn(1, NEW, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, n, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 4 * D * HQ * (NEW * (n - NEW) + NEW * (NEW + 1) / 2)
    dense = _time_us(partial(flash_attn_func, q, k, v, causal=True))
    want = flash_attn_func(q, k, v, causal=True).flatten(0, 1).float()
    print(f"cached={cached}: dense (library's choice) {dense:7.1f} us {flops / dense / 1e6:5.0f} TFLOP/s")
    cq = torch.tensor([0, NEW], device="cuda", dtype=torch.int32)
    ck = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    return q, k, v, n, flops, dense, want, cq, ck


def main(cached_list) -> None:
    import pagedflash

    print(f"pagedflash from {pagedflash.__file__}")
    for cached in cached_list:
        q, k, v, n, flops, dense, want, cq, ck = chunked_case(cached)
        for page, tiles in TILES.items():
            if page:
                nb = -(-n // page)
                table = permuted_table(nb, 1)
                pad = nb * page - n
                kk, vv = (to_pool(torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)), page, table) for x in (k, v))
            else:
                table, kk, vv = None, k.flatten(0, 1), v.flatten(0, 1)
            for bm, bn, w, st, tma in tiles:
                cfg = LaunchConfig(block_m=bm, block_n=bn, g_pack=1, num_warps=w, num_stages=st, tma=tma)
                run = partial(attention_forward, q.flatten(0, 1), kk, vv, batch=1, max_seqlen_q=NEW, max_seqlen_k=n,
                              sm_scale=D**-0.5, window=(-1, 0), softcap=0.0, cu_seqlens_q=cq, cu_seqlens_k=ck,
                              block_table=table, config=cfg)
                try:
                    err = (run()[0].float() - want).abs().max().item()
                    us = _time_us(run)
                except Exception as e:  # noqa: BLE001
                    print(f"  page={page} {cfg}: {type(e).__name__} {str(e)[:80]}")
                    continue
                print(f"  page={page:3d} bm={bm:3d} bn={bn:3d} w={w} s={st} tma={tma!s:5}: {us:7.1f} us "
                      f"{flops / us / 1e6:5.0f} TFLOP/s  x{dense / us:4.2f} dense  err={err:.2g}", flush=True)


def ir(dump: str) -> None:
    for path in sorted(glob.glob(f"{dump}/**/_attention_kernel.ttgir", recursive=True)):
        text = open(path).read()
        asyncs = len(re.findall(r"async_copy_global_to_local", text))
        tma = len(re.findall(r"async_tma_copy_global_to_local|tma_load|descriptor_load", text))
        loads2d = len(re.findall(r"tt\.load .*tensor<\d+x\d+x", text))
        wgmma = len(re.findall(r"warp_group_dot|nvidia_gpu\.warp_group_dot", text))
        mma = len(re.findall(r"tt\.dot ", text))
        warps = re.search(r'"ttg.num-warps" = (\d+)', text)
        shapes = sorted(set(re.findall(r"tensor<(\d+x\d+)xbf16", text)))
        print(f"{path.split('/')[-2][:8]}: warps {warps.group(1) if warps else '?'}, bf16 tiles {shapes}: "
              f"async copies {asyncs}, TMA loads {tma}, sync 2-D loads {loads2d}, wgmma {wgmma}, dots {mma}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ir"]:
        ir(sys.argv[2])
    else:
        main([int(x) for x in sys.argv[1:]] or [16384])

"""A/B timing of a few decode cells, public API only, so two checkouts can be compared in turns:
    PYTHONPATH=old python tools/decode_ab.py; PYTHONPATH=. python tools/decode_ab.py
Each cell: 20 calls captured in one CUDA graph, replayed, mean µs per call (K+V >> L2), and SDPA
cuDNN timed the same way in the same process (a machine-drift check)."""
import sys
from functools import partial

import torch
import torch.nn.functional as F
from graph_timing import graph_us  # tools/ is on sys.path when run as a script
from torch.nn.attention import SDPBackend, sdpa_kernel

import pagedflash
from pagedflash import flash_attn_with_kvcache, validate

CELLS = [(4, 65536), (4, 131072), (1, 16384), (1, 131072), (16, 16384)]
HQ, HKV, D, CALLS = 32, 8, 128, 20


def main() -> None:
    print(f"pagedflash from {pagedflash.__file__}", flush=True)
    validate.value_checks(False).__enter__()  # no device reads while capturing
    for b, n in CELLS:
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, n, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        ours = partial(flash_attn_with_kvcache, q, kc, vc, cache_seqlens=lens, num_splits=0)
        sdpa = partial(F.scaled_dot_product_attention, q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                       enable_gqa=True)
        pf = graph_us(lambda _, f=ours: f(), CALLS)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cu = graph_us(lambda _, f=sdpa: f(), CALLS)
        print(f"B={b} N={n}: pagedflash {pf:.1f} us  cudnn {cu:.1f} us  ratio {cu / pf:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

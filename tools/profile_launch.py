"""Host-side cost of one decode call: wall time per call without syncs, and a cProfile of it."""
import cProfile
import pstats
import sys
import time

import torch

from pagedflash import flash_attn_with_kvcache, validate

b, hq, hkv, d, n = 4, 16, 16, 64, 1024
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.float16)
kc, vc = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
with validate.value_checks(False):
    for splits in (1, 4):
        for _ in range(20):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
        host = (time.perf_counter() - t) / 200 * 1e6
        torch.cuda.synchronize()
        total = (time.perf_counter() - t) / 200 * 1e6
        print(f"splits={splits}: host {host:.1f} us/call, with drain {total:.1f} us/call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)

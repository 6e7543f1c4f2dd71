"""Host-side cost of one eager decode call: host µs per call (no syncs inside the loop), then a
cProfile of 200 calls sorted by own time.   python tools/profile_launch.py"""
import cProfile
import functools
import pstats
import sys

import torch

from pagedflash import flash_attn_with_kvcache, validate
from pagedflash.bench.common import host_us


def main() -> None:
    b, hq, hkv, d, n = 4, 16, 16, 64, 1024
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.float16)
    kc, vc = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.float16) for _ in range(2))
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    for splits in (1, 4):
        call = functools.partial(flash_attn_with_kvcache, q, kc, vc, cache_seqlens=lens, num_splits=splits)
        for _ in range(20):
            call()
        print(f"splits={splits}: host {host_us(call, calls=200):.1f} us/call")
        with validate.value_checks(False):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                call()
            prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()

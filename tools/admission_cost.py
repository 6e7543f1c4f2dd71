"""Host time of admitting prefix-cache hits: ``BlockManager.allocate`` + ``commit`` for requests that
share a cached system prompt (issue 30's shared-prefix point: 64 x (4096 + 128) ids, page 16). Least
of the rounds, ms a request; the development CPU's figures are in docs/performance.md v40.

    python tools/admission_cost.py [--prefix 4096] [--suffix 128] [--requests 64] [--page 16] [--rounds 7]
"""

import argparse
import random
import time

from pagedflash.cache import BlockManager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("prefix", 4096), ("suffix", 128), ("requests", 64), ("page", 16), ("rounds", 7)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    for name, least in (("prefix", 1), ("suffix", 1), ("requests", 2), ("page", 1), ("rounds", 1)):
        if getattr(a, name) < least:
            ap.error(f"--{name}: expected an int >= {least}, got {getattr(a, name)}")
    rng = random.Random(0)
    prefix = [rng.randrange(32000) for _ in range(a.prefix)]
    prompts = [prefix + [rng.randrange(32000) for _ in range(a.suffix)] for _ in range(a.requests)]
    n = a.prefix + a.suffix
    best = float("inf")
    for _ in range(a.rounds):
        bm = BlockManager(a.requests * -(-n // a.page) + 8, a.page)
        bm.allocate(0, prompts[0])
        bm.commit(0, n)  # the system prompt cached, as after a warm-up
        t0 = time.perf_counter()
        for i in range(1, a.requests):
            bm.allocate(i, prompts[i])
            bm.commit(i, n)
        best = min(best, (time.perf_counter() - t0) / (a.requests - 1))
    print(f"{a.requests - 1} prefix hits of {a.prefix} + {a.suffix} ids, page {a.page}: "
          f"{1e3 * best:.3f} ms a request (least of {a.rounds} rounds)")


if __name__ == "__main__":
    main()

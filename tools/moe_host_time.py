"""Host time of the MoE ops' Python on any machine (no GPU needed): ``fused_moe`` and ``route`` at the
Qwen3-30B-A3B and GPT-OSS-20B layer shapes, planned as an sm90 GPU of 132 SMs would plan them
(``compile_check``'s device answers), every launch recorded instead of run; µs a call and launches a call.
    PYTHONPATH=. python3 tools/moe_host_time.py [--tokens 1,4] [--calls 200]
What a GPU adds per launch (Triton's launcher, the driver) is not counted: the figure is pagedflash's own
share of an eager MoE layer's host time.
"""
import argparse
import functools
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before pagedflash: launches recorded, not interpreted

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_check  # noqa: E402  (tools/: the sm90 answers)

from pagedflash.bench.common import host_wall_us  # noqa: E402
from pagedflash.bench.moe import SHAPES  # noqa: E402
from pagedflash.ops import moe  # noqa: E402
from pagedflash.testing import recorded_launches  # noqa: E402


def per_call(fn, calls: int, launches: list) -> tuple[float, int]:
    """µs a call of ``fn`` (after 10 untimed) and the launches a call recorded."""
    launches.clear()
    us = host_wall_us(fn, calls=calls, warmup=10)[0]
    return us, len(launches) // (calls + 10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,4", help="comma-separated token counts T")
    p.add_argument("--calls", type=int, default=200, help="timed calls a case")
    args = p.parse_args()
    saved = compile_check._as_sm90()
    bf16 = dict(dtype=torch.bfloat16)
    try:
        with torch.inference_mode(), recorded_launches() as launches:
            for name, (h, i, e, k, act) in SHAPES.items():
                w13, w2 = torch.empty(e, 2 * i, h, **bf16), torch.empty(e, h, i, **bf16)
                for t in (int(x) for x in args.tokens.split(",")):
                    x, logits = torch.empty(t, h, **bf16), torch.empty(t, e, **bf16)
                    weights, ids = torch.rand(t, k), torch.randint(0, e, (t, k), dtype=torch.int32)
                    us, n = per_call(functools.partial(moe.fused_moe, x, w13, w2, weights, ids, activation=act),
                                     args.calls, launches)
                    rus, rn = per_call(functools.partial(moe.route, logits, k), args.calls, launches)
                    print(f"{name} T={t}: fused_moe {us:.1f} us ({n} launches), route {rus:.1f} us ({rn} launch)")
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


if __name__ == "__main__":
    main()

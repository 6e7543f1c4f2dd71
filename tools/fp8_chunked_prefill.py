"""Chunked prefill over fp8 vs bf16 paged pools, each through the Gluon kernel and the portable one.

    python tools/fp8_chunked_prefill.py [--both] [--batch-invariant] [--dims 128,64] [--pages 16,32,64,256]
        [--cells 4x16384,...]

512 new tokens a sequence over a cached prefix (cells ``BxP``: B sequences, P cached tokens), Hq/Hkv =
32/8, bf16 q, causal bottom-right; pools in random page order; fp8 = ``float8_e4m3fn`` with per-KV-head
scales (amax / 448). Prints TFLOP/s (exact causal FLOPs) per pool, kernel (G: the Gluon kernel ran, P:
the portable one) and page size, the fp8÷bf16 speed ratio of the Gluon launches, and the max error of
the fp8 launch against the fp32 reference over the dequantized pool (cells up to 16K cached tokens).
``--both`` also times every launch with the Gluon kernel switched off (``prefill_hopper.ENABLED``);
``--batch-invariant`` also times it with ``batch_invariant=True`` and prints that time over the same
launch's with the mode off (``inv G 1.30x``: the kernel that ran in the mode, G or P; under ``--both``
the portable line's is the portable kernel on over off: ``PAGEDFLASH_INVARIANT_GLUON=0`` without
``--both`` gives the portable mode over the Gluon kernel off).
CUDA-graph replays, L2 flushed as the benchmarks do (``pagedflash.bench.common.time_ms``).
"""

import argparse
import functools

import torch

import pagedflash as pf
from pagedflash import reference as ref
from pagedflash.bench.common import set_timing, time_ms
from pagedflash.bench.decode import kv_scale, quantize
from pagedflash.cache import cu_seqlens_tensor
from pagedflash.ops import prefill_hopper
from pagedflash.testing import random_block_table, to_paged

NEW, HQ, HKV = 512, 32, 8


def pools(x: torch.Tensor, page: int, table: torch.Tensor) -> torch.Tensor:
    """``x [B, S, Hkv, D]`` as a pool of ``page``-row pages at ``table`` (padded as bytes: fp8 too)."""
    pad = table.shape[1] * page - x.shape[1]
    raw = torch.nn.functional.pad(x.view(torch.uint8) if x.element_size() == 1 else x, (0, 0, 0, 0, 0, pad))
    return to_paged(raw, page, table).view(x.dtype)


def run_once(fn) -> tuple:
    """``fn()``'s result and the kernel that ran it: G (the Gluon kernel) or P (the portable one)."""
    before = prefill_hopper.launches
    result = fn()
    return result, "G" if prefill_hopper.launches > before else "P"


def cell(d: int, b: int, prefix: int, pages: list[int], both: bool, invariant: bool) -> str:
    sk = prefix + NEW
    q = torch.randn(b * NEW, HQ, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(b, sk, HKV, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    kd, vd = kv_scale(k), kv_scale(v)
    k8, v8 = quantize(k, kd), quantize(v, vd)
    cu_q, cu_k = cu_seqlens_tensor([NEW] * b, device="cuda"), cu_seqlens_tensor([sk] * b, device="cuda")
    flops = 4 * d * HQ * b * (NEW * (sk - NEW) + NEW * (NEW + 1) / 2)
    line = f"D={d} B={b} P={prefix}:"
    for page in pages:
        width = -(-sk // page)
        table = random_block_table([width] * b, b * width, device="cuda")
        ms = {}
        for name, kc, vc, scales in (("bf16", pools(k, page, table), pools(v, page, table), {}),
                                     ("fp8", pools(k8, page, table), pools(v8, page, table),
                                      dict(k_descale=kd, v_descale=vd))):
            def call(kc=kc, vc=vc, table=table, scales=scales, mode=False):
                return pf.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, NEW, sk, causal=True, block_table=table,
                                                 batch_invariant=mode, **scales)
            out = None
            for gluon in (True, False) if both else (True,):
                prefill_hopper.ENABLED = gluon
                result, kind = run_once(call)
                out = result if gluon else out
                ms[name, gluon] = time_ms(call)
                line += f" p{page} {name} {kind} {flops / ms[name, gluon] / 1e9:.0f}"
                if invariant:
                    in_mode = functools.partial(call, mode=True)
                    _, kind = run_once(in_mode)
                    line += f" inv {kind} {time_ms(in_mode) / ms[name, gluon]:.2f}x"
            prefill_hopper.ENABLED = True
            if name == "fp8" and prefix <= 16384:
                want = ref.paged_varlen_attention_ref(q[:NEW], ref.dequantize_ref(kc, kd), ref.dequantize_ref(vc, vd),
                                                      cu_q[:2], cu_k[:2], table[:1], causal=True)[0]
                line += f" err {(out[:NEW].float() - want).abs().max().item():.4f}"
        line += f" | p{page} fp8÷bf16 {ms['bf16', True] / ms['fp8', True]:.2f} ||"
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--both", action="store_true", help="also time the portable kernel")
    p.add_argument("--batch-invariant", action="store_true", help="also time each launch in the batch-invariant mode")
    p.add_argument("--dims", default="128,64")
    p.add_argument("--pages", default="16,32,64,256")
    p.add_argument("--cells", default="4x16384", help="BxP, comma-separated")
    args = p.parse_args()
    set_timing(warmup_ms=10, rep_ms=40)
    for d in map(int, args.dims.split(",")):
        for spec in args.cells.split(","):
            b, prefix = map(int, spec.split("x"))
            print(cell(d, b, prefix, [int(x) for x in args.pages.split(",")], args.both,
                       args.batch_invariant), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

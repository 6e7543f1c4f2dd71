"""Issue 32: what the batch-invariant mode's split rule costs each kernel, on a few prefill and decode
cells (bf16; decode 32 query / 8 KV heads; the 1B engine's decode-graph launches over 16-row pages, as the
graph makes them: packed one-row queries, causal, the graph's split count and 131,072-key
length), mode off and on in one process, printed as on/off time.

The rule is read when pagedflash loads, so compare rules by running this once per environment:
    PYTHONPATH=. python3 tools/invariant_splits.py                                   # the default rule
    PAGEDFLASH_INVARIANT_HEAD_KEYS=0 PYTHONPATH=. python3 tools/invariant_splits.py  # 2048-key splits only
    PAGEDFLASH_INVARIANT_MID_KEYS=32768 PYTHONPATH=. python3 tools/invariant_splits.py  # 1,024-key splits to 32K
    PAGEDFLASH_INVARIANT_GLUON=0 PYTHONPATH=. python3 tools/invariant_splits.py  # the mode's prefill portable
(a shorter cut than `pagedflash bench decode|prefill --batch-invariant`; docs/performance.md v43).
``--engine``: the engine's decode cells only; ``--prefill``: the prefill cells only; ``--fp8``: contiguous
decode over fp8 (e4m3) caches only, the cells where the split programs' count matters most.
``--engine-cells B:LO:HI,...``: the engine's decode cells given (B rows of LO-HI keys) instead of its own,
e.g. a batch sweep for the decode tile's admission (``PAGEDFLASH_INVARIANT_DECODE_WAVES``):
    PYTHONPATH=. python3 tools/invariant_splits.py --engine-cells 16:1024:1024,32:1024:1024,64:1024:1024,64:32768:32768
"""
import functools
import os
import sys

import torch

import pagedflash as pf
from pagedflash.bench.common import time_ms
from pagedflash.engine.runner import graph_num_splits
from pagedflash.ops import launch, prefill_hopper

PREFILL = ((4, 32, 4096, 128, True), (4, 32, 4096, 128, False), (1, 32, 16384, 128, True),
           (8, 32, 1024, 64, True), (2, 32, 8192, 64, True))  # B, H, N, D, causal
DECODE = ((1, 1024, 128), (1, 4096, 128), (1, 32768, 64), (1, 65536, 128), (1, 131072, 64), (16, 16384, 128),
          (64, 4096, 128), (64, 16384, 128), (4, 32768, 64))  # B, N, D
DECODE_FP8 = ((1, 32768), (4, 16384), (4, 65536), (4, 131072), (16, 16384), (16, 65536), (16, 131072),
              (64, 16384))  # B, N; D = 128
# B, keys from, to: the 1B engine's decode steps (the last four also `bench serve --sections itl` cells)
ENGINE_DECODE = ((256, 200, 2000), (64, 200, 2000), (32, 1024, 1024), (32, 32768, 32768), (1, 1024, 1024),
                 (1, 32768, 32768))


def on_off(call) -> str:
    """``call(batch_invariant)`` timed with the mode off and on: the line's figures."""
    off, on = (time_ms(functools.partial(call, mode)) for mode in (False, True))
    return f"off {off * 1e3:.1f} us on {on * 1e3:.1f} us  on/off {on / off:.3f}"


def prefill(b, h, n, d, causal) -> str:
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return on_off(lambda mode: pf.flash_attn_func(q, k, v, causal=causal, batch_invariant=mode))


def decode(b, n, d, fp8: bool = False) -> str:
    """Contiguous decode, 32 query / 8 KV heads; ``fp8``: e4m3 K/V with per-head descales."""
    q = torch.randn(b, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, n, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scales = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scale = torch.full((8,), 0.5, device="cuda")
        scales = dict(k_descale=scale, v_descale=scale)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    return on_off(lambda mode: pf.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, batch_invariant=mode,
                                                          **scales))


def engine_decode(b, lo, hi, d, page=16, graph_keys=131072) -> str:
    """The 1B engine's decode step as its CUDA graph launches it: ``b`` rows of ``lo``-``hi`` random
    keys over ``page``-row pages (scattered), 32 query / 8 KV heads, one query row a sequence packed
    (varlen, causal), the graph's ``max_seqlen_k`` (``graph_keys``, the model length: table columns
    past a row's pages point at page 0) and split count (``graph_num_splits``)."""
    gen = torch.Generator().manual_seed(b)
    lens = torch.randint(lo, hi + 1, (b,), generator=gen, dtype=torch.int32)
    per_row, width = -(-hi // page), -(-max(hi, graph_keys) // page)
    table = torch.zeros(b, width, dtype=torch.int32)
    table[:, :per_row] = torch.randperm(b * per_row, generator=gen).to(torch.int32).view(b, per_row)
    k, v = (torch.randn(b * per_row, page, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, 32, d, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32).cuda()
    splits = graph_num_splits(b, 8, torch.cuda.get_device_properties(0).multi_processor_count)
    table = table.cuda()
    return on_off(lambda mode: pf.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, width * page, causal=True,
                                                         block_table=table, num_splits=splits, batch_invariant=mode))


def main() -> None:
    args = sys.argv[1:]
    engine_only, prefill_only = "--engine" in args, "--prefill" in args
    cells = ENGINE_DECODE
    if "--engine-cells" in args:
        engine_only = True
        try:
            cells = [tuple(int(x) for x in cell.split(":")) for cell in args[args.index("--engine-cells") + 1].split(",")]
        except (IndexError, ValueError):
            cells = []
        if not cells or any(len(c) != 3 or not 1 <= c[1] <= c[2] or c[0] < 1 for c in cells):
            raise SystemExit("--engine-cells: expected B:LO:HI[,B:LO:HI...] (B >= 1, 1 <= LO <= HI)")
    if not torch.cuda.is_available():
        raise SystemExit("invariant_splits.py times GPU kernels: no CUDA device here")
    torch.manual_seed(0)
    rule = launch.invariant_split_rule(False, 128)
    mid = f", to key {rule.mid_end} in splits of {rule.mid_split}" if rule.mid_end > rule.head_keys else ""
    print(f"== split rule: the first {rule.head_keys} keys in splits of {rule.head_split}{mid}, then {rule.keys} "
          f"({os.environ.get('PAGEDFLASH_INVARIANT_HEAD_KEYS', 'default head')}); the mode's prefill in the Gluon "
          f"kernel: {prefill_hopper.INVARIANT_ENABLED} (PAGEDFLASH_INVARIANT_GLUON)")
    if "--fp8" in args:
        for b, n in DECODE_FP8:
            print(f"decode fp8 B={b} N={n} D=128: {decode(b, n, 128, fp8=True)}")
        return
    for b, h, n, d, causal in () if engine_only else PREFILL:
        print(f"prefill B={b} N={n} D={d} causal={causal}: {prefill(b, h, n, d, causal)}")
    for b, n, d in () if engine_only or prefill_only else DECODE:
        print(f"decode B={b} N={n} D={d}: {decode(b, n, d)}")
    for b, lo, hi in () if prefill_only else cells:
        print(f"engine decode B={b} N={lo}-{hi} D=64 pages 16: {engine_decode(b, lo, hi, 64)}")


if __name__ == "__main__":
    main()

"""Experiment (v15): rewrite a copy of ops/attention.py so that its key loop runs under Triton's
warp specialization (``tl.range(..., warp_specialize=True)``: producer warps issue the K/V loads,
consumer warps compute), to time against the committed kernel:
    mkdir -p /tmp/ws && cp -r pagedflash tools /tmp/ws && python tools/variant_warp_specialize.py /tmp/ws/pagedflash/ops/attention.py
    PYTHONPATH=/tmp/ws python -m pagedflash bench tune --only decode --cells 16x1024 --tiles 64:4:3:tma"""
import sys

LOOP = "    for start_n in range(lo, hi, BLOCK_N):\n"
path = sys.argv[1]
src = open(path).read()
if LOOP not in src:
    sys.exit(f"{path}: the key loop is not where this script expects it")
open(path, "w").write(src.replace(LOOP, "    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):\n"))

"""Experiment (v6, v15): rewrite a copy of ops/attention.py so that each key tile reads its block-table
entries in its own iteration instead of one tile ahead, to time against the committed kernel:
    cp -r pagedflash tools /tmp/v && python tools/variant_table_in_tile.py /tmp/v/pagedflash/ops/attention.py
    PYTHONPATH=/tmp/v python /tmp/v/tools/paged_prefill_probe.py
(v15: slower on every paged tile, page 16 0.65 -> 0.55x dense, page 64 TMA 0.99 -> 0.78x.)"""
import sys

AHEAD_PROLOGUE = '''    if PAGED:  # the table entries of the first tile; each step fetches the next tile's ahead of use
        blk_next = _pages(BlockTable, b, stride_tb, lo, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''
AHEAD_STEP = '''        if PAGED:  # a load issued a whole tile before its use: the K/V addresses never wait on it
            blk = blk_next
            blk_next = _pages(BlockTable, b, stride_tb, start_n + BLOCK_N, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''
IN_TILE_STEP = '''        if PAGED:
            blk = _pages(BlockTable, b, stride_tb, start_n, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''

path = sys.argv[1]
src = open(path).read()
if AHEAD_PROLOGUE not in src or AHEAD_STEP not in src:
    sys.exit(f"{path}: the look-ahead code is not where this script expects it")
open(path, "w").write(src.replace(AHEAD_PROLOGUE, "").replace(AHEAD_STEP, IN_TILE_STEP))

"""Experiment (v15): rewrite a copy of ops/attention.py so that block-table entries are read two key
tiles ahead of their use instead of one (a pipeline of depth 3 issues a tile's K/V loads two
iterations early; an entry read one tile ahead may hold them back), to time against the committed
kernel:
    cp -r pagedflash tools /tmp/v && python tools/variant_table_two_ahead.py /tmp/v/pagedflash/ops/attention.py
    PYTHONPATH=/tmp/v python /tmp/v/tools/paged_prefill_probe.py"""
import sys

AHEAD_PROLOGUE = '''    if PAGED:  # the table entries of the first tile; each step fetches the next tile's ahead of use
        blk_next = _pages(BlockTable, b, stride_tb, lo, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''
AHEAD_STEP = '''        if PAGED:  # a load issued a whole tile before its use: the K/V addresses never wait on it
            blk = blk_next
            blk_next = _pages(BlockTable, b, stride_tb, start_n + BLOCK_N, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''
TWO_PROLOGUE = '''    if PAGED:
        blk_next = _pages(BlockTable, b, stride_tb, lo, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
        blk_next2 = _pages(BlockTable, b, stride_tb, lo + BLOCK_N, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''
TWO_STEP = '''        if PAGED:
            blk = blk_next
            blk_next = blk_next2
            blk_next2 = _pages(BlockTable, b, stride_tb, start_n + 2 * BLOCK_N, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''

path = sys.argv[1]
src = open(path).read()
if AHEAD_PROLOGUE not in src or AHEAD_STEP not in src:
    sys.exit(f"{path}: the look-ahead code is not where this script expects it")
open(path, "w").write(src.replace(AHEAD_PROLOGUE, TWO_PROLOGUE).replace(AHEAD_STEP, TWO_STEP))

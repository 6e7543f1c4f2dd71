"""Experiment (v6, v15): rewrite a copy of ops/attention.py so that the block-table entries of a key
tile are read in its own iteration (``in-tile``) or two tiles ahead (``two-ahead``) instead of one
tile ahead, to time against the committed kernel:
    mkdir -p /tmp/v && cp -r pagedflash tools /tmp/v
    python tools/variant_table_lookahead.py in-tile /tmp/v/pagedflash/ops/attention.py
    PYTHONPATH=/tmp/v python /tmp/v/tools/paged_prefill_probe.py
v15, chunked prefill over pages vs dense (committed: page 16 0.64-0.70x, page 64 TMA 0.99x): in-tile
page 16 0.48-0.59x, page 64 TMA 0.78x; two-ahead page 16 0.48-0.51x, page 64 TMA 0.50-0.52x."""
import sys

PROLOGUE = '''    if PAGED:  # the table entries of the first tile; each step fetches the next tile's ahead of use
        blk_next = _pages(BlockTable, b, stride_tb, lo, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''
STEP = '''        if PAGED:  # a load issued a whole tile before its use: the K/V addresses never wait on it
            blk = blk_next
            blk_next = _pages(BlockTable, b, stride_tb, start_n + BLOCK_N, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''
VARIANTS = {  # mode -> (prologue, step)
    "in-tile": ("", '''        if PAGED:
            blk = _pages(BlockTable, b, stride_tb, start_n, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''),
    "two-ahead": ('''    if PAGED:
        blk_next = _pages(BlockTable, b, stride_tb, lo, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
        blk_next2 = _pages(BlockTable, b, stride_tb, lo + BLOCK_N, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
''', '''        if PAGED:
            blk = blk_next
            blk_next = blk_next2
            blk_next2 = _pages(BlockTable, b, stride_tb, start_n + 2 * BLOCK_N, seqlen_k, offs_n, PAGE_SIZE, BLOCK_N)
'''),
}

if len(sys.argv) != 3 or sys.argv[1] not in VARIANTS:
    sys.exit(f"usage: {sys.argv[0]} {{{','.join(VARIANTS)}}} PATH/ops/attention.py")
mode, path = sys.argv[1:]
src = open(path).read()
if PROLOGUE not in src or STEP not in src:
    sys.exit(f"{path}: the look-ahead code is not where this script expects it")
prologue, step = VARIANTS[mode]
open(path, "w").write(src.replace(PROLOGUE, prologue).replace(STEP, step))

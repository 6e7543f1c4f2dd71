"""The batch-invariant GEMM (pagedflash.ops.matmul) against its fp32 reference, and its property:
row ``i`` of the output bitwise the same whatever ``M`` is and wherever the row sits in ``x``.

Under the interpreter: odd sizes (``M``, ``N``, ``K`` not multiples of the tiles), rows of x and the
weight that are strided views into NaN-padded buffers (a load past a row's end, or past the last
row, shows as NaN), outputs from NaN-poisoned ``torch.empty``, and a small forced tile so that each
program walks several output tiles.

The interpreter's ``tl.dot`` is numpy's matmul (OpenBLAS), whose result for a row depends on the
row's position among the operand's rows (its fp32 micro-kernel computes rows 6-11 of every 12 in
another order). An MMA computes each output element by itself, so the invariance tests give the
interpreter a dot of that kind (:func:`pagedflash.testing.row_exact_interpreter_dot`): what
they check under the interpreter is the kernel's part, the tiles and the order over ``K`` that do
not depend on ``M``. Compiled on a GPU they run the real dot, with bf16 and Llama-3-8B shapes.
"""

import inspect

import pytest
import torch
import torch._dynamo.testing
from helpers import DEVICE, DTYPES, ON_GPU, assert_close, ids, randn
from test_ops_layers import in_wider_rows

from pagedflash import reference as ref
from pagedflash.ops import activation, custom_ops
from pagedflash.ops import matmul as mm
from pagedflash.ops.activation import ACTIVATIONS
from pagedflash.ops.utils import interpreted
from pagedflash.testing import capture_graph, row_exact_interpreter_dot

gpu_only = pytest.mark.skipif(not ON_GPU, reason="real sizes and the real dot are for the compiled GPU run")
GPU_DTYPES = [torch.bfloat16, torch.float16]
SMALL_TILE = mm.Tile(16, 16, 16, 4, 1, 2)  # 16 programs on the CPU: each walks several tiles, groups ragged
# K = 100 in chunks of 32 (the last one 4 keys): below 16 output tiles one program per (tile, chunk)
# and the fold kernel, above one program per tile adding its chunks (the interpreter's 16 SMs)
CHUNK_TILE = mm.Tile(16, 16, 16, 4, 1, 2, chunk_k=32)
# DECODE_TILES with forced tiles: 16 rows or fewer run 16 columns by 32-deep K steps, more rows 32 by 16
# (same rows, warps; the interpreter's dot chains 16-deep steps as an MMA does)
WIDE_TILE, NARROW_TILE = mm.Tile(16, 32, 16, 4, 1, 2), mm.Tile(16, 16, 32, 4, 2, 2)
# ROW_TILES with a forced tall tile: 32 rows by 16 columns by 32-deep steps, 8 warps, where it fills the SMs
TALL_TILE = mm.Tile(32, 16, 32, 8, 2, 2)
# Llama-3-8B's projections (N, K): qkv, o_proj, gate_up, down
LLAMA_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.fixture
def per_element_dot():
    """Under the interpreter, ``tl.dot`` as an MMA computes it (module doc); nothing changes on a GPU."""
    with row_exact_interpreter_dot():
        yield


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes: equal bits, not equal values (-0.0 != 0.0, a NaN equals the same NaN)."""
    return t.contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------------------------- values
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("n,k", [(37, 100), (100, 64), (20, 5)], ids=["ragged", "even_k", "short_k"])
@pytest.mark.parametrize("m", [1, 3, 65, 130])
@pytest.mark.parametrize("bias,use_out", [(True, False), (False, True)], ids=["bias", "out"])
def test_matmul_matches_reference(m, n, k, dtype, bias, use_out):
    x, w = in_wider_rows(randn(m, k, dtype=dtype)), in_wider_rows(randn(n, k, dtype=dtype))
    b = randn(n, dtype=dtype) if bias else None
    if use_out:
        buf = torch.full((m + 1, n + 5), 7.0, dtype=dtype, device=DEVICE)
        out = buf[:m, :n].fill_(float("nan"))  # rows strided; a write past a row or the last row shows
        assert mm.matmul(x, w, b, out=out) is out
        assert (buf[:, n:] == 7).all() and (buf[m] == 7).all()
    else:
        out = mm.matmul(x, w, b)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, ref.matmul_ref(x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_small_tile_many_tiles_per_program(monkeypatch, dtype):
    """63 output tiles over 16 programs, row groups of 2 over 9 row blocks (the last group ragged)."""
    monkeypatch.setattr(mm, "TILE", SMALL_TILE)
    x, w, b = randn(130, 40, dtype=dtype), in_wider_rows(randn(100, 40, dtype=dtype)), randn(100, dtype=dtype)
    assert_close(mm.matmul(x, w, b), ref.matmul_ref(x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("m", [1, 100, 130])  # 3 and 21 output tiles: one program per (tile, chunk); 27: per tile
@pytest.mark.parametrize("bias,use_out", [(True, False), (False, True)], ids=["bias", "out"])
def test_chunked_k_matches_reference(monkeypatch, m, dtype, bias, use_out):
    monkeypatch.setattr(mm, "TILE", CHUNK_TILE)
    monkeypatch.setattr(mm, "num_sms", lambda device: 16)  # the form switches at 16 tiles on any device
    x, w = in_wider_rows(randn(m, 100, dtype=dtype)), in_wider_rows(randn(37, 100, dtype=dtype))
    b = randn(37, dtype=dtype) if bias else None
    out = in_wider_rows(torch.full((m, 37), float("nan"), dtype=dtype, device=DEVICE)) if use_out else None
    got = mm.matmul(x, w, b, out=out)
    assert_close(got, ref.matmul_ref(x, w, b), dtype)
    split = mm._PLANS[mm.plan_key(x, w, b, got)].fold is not None
    assert split == (m < 100), "the split form below 16 output tiles, the folded one above"


def test_chunk_not_a_multiple_of_block_k_is_refused(monkeypatch):
    monkeypatch.setattr(mm, "TILE", CHUNK_TILE._replace(chunk_k=24))
    with pytest.raises(ValueError, match=r"matmul.TILE: chunk_k: expected 0 or a positive multiple of block_k \(16\)"):
        mm.matmul(randn(3, 96), randn(5, 96))


def test_chunk_rule(monkeypatch):
    """With CHUNK_K on an H200 (132 SMs): chunks where the column tiles fill less than half the SMs,
    at least MIN_CHUNK keys, tiles x chunks about the SM count; none on the wide gate/up."""
    monkeypatch.setattr(mm, "CHUNK_K", True)
    monkeypatch.setattr(mm, "num_sms", lambda device: 132)
    monkeypatch.setattr(mm, "nvidia_capability", lambda device: (9, 0))
    chunks = {name: mm.tile(n, k, torch.bfloat16, DEVICE).chunk_k for name, (n, k) in LLAMA_8B.items()}
    assert chunks == {"qkv": 1408, "o_proj": 1024, "gate_up": 0, "down": 2944}
    assert mm.tile(2048, 1024, torch.bfloat16, DEVICE).chunk_k == 0  # one chunk: none
    monkeypatch.setattr(mm, "CHUNK_K", False)
    assert all(mm.tile(n, k, torch.bfloat16, DEVICE).chunk_k == 0 for n, k in LLAMA_8B.values())


@pytest.mark.parametrize("chunk_k", [False, True], ids=["whole_k", "chunked"])
def test_decode_tile_rule(monkeypatch, chunk_k):
    """On an H200 (sm90, 132 SMs) the decode tile differs from the weight's tile in its columns, K
    steps and stages only (what orders a row's sum stays: the rows, the warps, the K chunks), narrows
    the 2048-4096-wide layers until their column tiles fill the SMs, takes 256-deep steps at 16
    columns (not where a K chunk is no multiple of them), fits sm90's shared memory, and leaves fp32
    and other devices alone."""
    monkeypatch.setattr(mm, "CHUNK_K", chunk_k)
    monkeypatch.setattr(mm, "num_sms", lambda device: 132)
    monkeypatch.setattr(mm, "nvidia_capability", lambda device: (9, 0))
    llama_1b = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                "lm_head": (128256, 2048)}
    for n, k in [*LLAMA_8B.values(), *llama_1b.values()]:
        main = mm.tile(n, k, torch.bfloat16, DEVICE)
        t = mm.decode_tile(main, n, k, torch.bfloat16, DEVICE)
        assert t._replace(block_n=main.block_n, block_k=main.block_k, stages=main.stages) == main
        assert mm.DECODE_MIN_N <= t.block_n <= main.block_n and t.stages >= main.stages
        assert t.stages * (t.block_m + t.block_n) * t.block_k * 2 <= mm.SMEM_SM90
        assert t.block_n == mm.DECODE_MIN_N or 2 * -(-n // t.block_n) > 132
        deep = t.block_n == mm.DECODE_MIN_N and main.chunk_k % mm.DECODE_DEEP_K == 0
        assert t.block_k == (mm.DECODE_DEEP_K if deep else main.block_k) and t.chunk_k % t.block_k == 0
    # Llama-3.2-1B: qkv 32 columns by 128, o_proj and down 16 by 256 (v41's best at M = 64), gate/up 128 by 64
    tiles = {name: mm.decode_tile(mm.tile(n, k, torch.bfloat16, DEVICE), n, k, torch.bfloat16, DEVICE)
             for name, (n, k) in llama_1b.items()}
    if not chunk_k:
        assert [(t.block_n, t.block_k) for t in tiles.values()] == [(32, 128), (16, 256), (128, 64), (16, 256),
                                                                   (256, 64)]
    main = mm.tile(2048, 2048, torch.float32, DEVICE)
    assert mm.decode_tile(main, 2048, 2048, torch.float32, DEVICE) == main
    monkeypatch.setattr(mm, "nvidia_capability", lambda device: (8, 0))
    main = mm.tile(2048, 2048, torch.bfloat16, DEVICE)
    assert mm.decode_tile(main, 2048, 2048, torch.bfloat16, DEVICE) == main


def test_rows_tile_rule(monkeypatch):
    """On an H100 (sm90, 132 SMs) calls of more than 64 rows take the widest tile whose tiles reach
    half the SMs: the 1B shape's o_proj (N = K = 2048) narrows its 64-row tile to 32, 64, then its
    own 128 columns as the rows grow, then stacks two warpgroups (128 x 128, 128 x 256); gate/up
    (N = 16,384) is wide enough for 128 x 128 from 65 rows. Row tiles off: the weight's tile."""
    monkeypatch.setattr(mm, "num_sms", lambda device: 132)
    monkeypatch.setattr(mm, "nvidia_capability", lambda device: (9, 0))

    def shape(m, n, k):
        t = mm.rows_tile(mm.tile(n, k, torch.bfloat16, DEVICE), m, n, k, torch.bfloat16, DEVICE)
        return t.block_m, t.block_n

    o_proj = {65: (64, 32), 128: (64, 32), 129: (64, 64), 256: (64, 64), 257: (64, 128), 512: (64, 128),
              513: (128, 128), 1024: (128, 128), 1025: (128, 256), 8192: (128, 256)}
    assert {m: shape(m, 2048, 2048) for m in o_proj} == o_proj
    assert shape(65, 16384, 2048) == (128, 128) and shape(257, 16384, 2048) == (128, 256)
    monkeypatch.setattr(mm, "DECODE_TILES", False)  # no narrowing: the weight's own tile below the tall ones
    assert shape(65, 2048, 2048) == (64, 128) and shape(1025, 2048, 2048) == (128, 256)
    tall = mm.tall_tile(mm.tile(40, 48, torch.bfloat16, DEVICE), 40, 48, torch.bfloat16, DEVICE)
    assert (tall.block_n, tall.block_k) == (64, 64)  # no wider than N and K need (K = 48: 64-deep, padded)


@pytest.mark.parametrize("chunk_k", [False, True], ids=["whole_k", "chunked"])
def test_tall_tile_rule(monkeypatch, chunk_k):
    """On sm90 the 128-row tile stacks two of the weight tile's 64-row warpgroups (128 rows, 8 warps:
    the same wgmma a warpgroup), keeps its K chunks and fits sm90's shared memory; fp32 and other
    devices keep the weight's tile. A forced tile must keep the K chunks."""
    monkeypatch.setattr(mm, "CHUNK_K", chunk_k)
    monkeypatch.setattr(mm, "num_sms", lambda device: 132)
    monkeypatch.setattr(mm, "nvidia_capability", lambda device: (9, 0))
    for n, k in [*LLAMA_8B.values(), (2048, 2048), (3072, 2048), (16384, 2048), (2048, 8192), (40, 2048)]:
        main = mm.tile(n, k, torch.bfloat16, DEVICE)
        t = mm.tall_tile(main, n, k, torch.bfloat16, DEVICE)
        assert (t.block_m, t.warps, t.group_m, t.chunk_k) == (2 * mm.BLOCK_M, 8, main.group_m, main.chunk_k)
        assert t.block_n == min(256, max(16, 1 << (n - 1).bit_length())) and t.chunk_k % t.block_k == 0
        assert 3 <= t.stages and t.stages * (t.block_m + t.block_n) * t.block_k * 2 <= mm.SMEM_SM90
    main = mm.tile(2048, 2048, torch.float32, DEVICE)
    assert mm.tall_tile(main, 2048, 2048, torch.float32, DEVICE) == main
    monkeypatch.setattr(mm, "nvidia_capability", lambda device: (8, 0))
    main = mm.tile(2048, 2048, torch.bfloat16, DEVICE)
    assert mm.tall_tile(main, 2048, 2048, torch.bfloat16, DEVICE) == main
    monkeypatch.setattr(mm, "ROW_TILES", True)
    monkeypatch.setattr(mm, "TILE", WIDE_TILE)
    monkeypatch.setattr(mm, "TALL_TILE", TALL_TILE._replace(chunk_k=32))
    with pytest.raises(ValueError, match=r"matmul.TALL_TILE: expected chunk_k 0"):
        mm.matmul(randn(200, 64), randn(5, 64))


@pytest.mark.parametrize("m,n,k", [(0, 5, 8), (4, 0, 8), (4, 5, 0)], ids=["no_rows", "no_columns", "no_k"])
def test_empty_dimensions(m, n, k):
    """As ``torch.nn.functional.linear``: an empty output, or (K = 0) the bias alone."""
    x, w, b = randn(m, k), randn(n, k), randn(n)
    out = mm.matmul(x, w, b)
    assert out.shape == (m, n)
    assert torch.equal(out, ref.matmul_ref(x, w, b))


# ---------------------------------------------------------------------------------------------- invariance
def check_rows_invariant(x: torch.Tensor, w: torch.Tensor, b, rows) -> None:
    """Row ``i`` of ``matmul(x)`` equals, bit for bit: the row alone (M = 1); the row at positions
    0, 3 and 6 of a batch of 7 other rows; the row inside ``x`` reversed (another position, another
    row tile); the row read through a strided view of x, written through a strided ``out``."""
    m, dtype = x.shape[0], x.dtype
    full = mm.matmul(x, w, b)
    others = randn(7, x.shape[1], dtype=dtype)
    flipped = mm.matmul(x.flip(0), w, b)
    strided_out = in_wider_rows(torch.empty(m, w.shape[0], dtype=dtype, device=DEVICE), fill=0.0)
    mm.matmul(in_wider_rows(x), w, b, out=strided_out)
    for i in rows:
        want = bits(full[i])
        assert torch.equal(bits(mm.matmul(x[i:i + 1], w, b)[0]), want), f"row {i} alone"
        for pos in (0, 3, 6):
            batch = others.clone()
            batch[pos] = x[i]
            assert torch.equal(bits(mm.matmul(batch, w, b)[pos]), want), f"row {i} at {pos} of 7"
        assert torch.equal(bits(flipped[m - 1 - i]), want), f"row {i} at {m - 1 - i} of {m}"
        assert torch.equal(bits(strided_out[i]), want), f"row {i} through strided views"


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("tile", [None, SMALL_TILE, CHUNK_TILE, "decode", "rows", "warp"],
                         ids=["table", "small_tile", "chunked", "decode_tiles", "row_tiles", "warp_tile"])
def test_rows_are_batch_invariant(per_element_dot, monkeypatch, dtype, bias, tile):
    decode, rows, warp = tile == "decode", tile == "rows", tile == "warp"
    monkeypatch.setattr(mm, "DECODE_TILES", decode)
    monkeypatch.setattr(mm, "ROW_TILES", rows)
    if decode:  # rows alone and in 7 run the narrow tile, 130 rows the wide one
        monkeypatch.setattr(mm, "DECODE_TILE", NARROW_TILE)
        tile = WIDE_TILE
    if rows:  # 130 rows run the tall tile (5 x 3 tiles fill 4 SMs), rows alone and in 7 the wide one
        monkeypatch.setattr(mm, "TALL_TILE", TALL_TILE)
        tile = WIDE_TILE
    if warp:  # rows alone and in 7 run one warp's 16 rows by 32-deep steps, 130 rows the wide tile
        monkeypatch.setattr(mm, "WARP_TILE", mm.parse_warp_tile("16:16:32:1:2"))
        tile = WIDE_TILE
    monkeypatch.setattr(mm, "TILE", tile)
    # chunked: 130 rows folded, 1 and 7 split
    monkeypatch.setattr(mm, "num_sms", lambda device: 4 if rows else 16)
    x, w = randn(130, 100, dtype=dtype), in_wider_rows(randn(37, 100, dtype=dtype))
    b = randn(37, dtype=dtype) if bias else None
    check_rows_invariant(x, w, b, rows=[0, 6, 11, 63, 64, 129])
    if decode or rows or warp:  # which tile each call ran
        want = (((1, "BLOCK_N", 16), (130, "BLOCK_N", 32)) if decode else ((7, "BLOCK_M", 16), (130, "BLOCK_M", 32))
                if rows else ((7, "BLOCK_K", 32), (130, "BLOCK_K", 16)))
        for rows, const, value in want:
            out = mm.matmul(x[:rows], w, b)
            assert mm._PLANS[mm.plan_key(x[:rows], w, b, out)].main.consts[const] == value


def test_warp_tile_variable():
    """Unset: sm90's warp tile (16-bit calls there only), no tile for every device; ``0``: none anywhere."""
    assert mm.WARP_TILE is None and mm.WARP_TILE_SM90 == mm.SM90_WARP_TILE == mm.Tile(16, 16, 256, 2, 4, 0)
    assert mm.parse_warp_tile("") is None and mm.parse_warp_tile("0") is None
    assert mm.parse_warp_tile("16:32:256:1:4") == mm.Tile(16, 32, 256, 1, 4, 0)
    for bad in ("16:32:256:1", "16:32:256:3:4", "8:32:256:1:4", "128:32:256:4:4", "16:32:8:1:4", "16:a:256:1:4"):
        with pytest.raises(ValueError, match=r"PAGEDFLASH_MATMUL_WARP_TILE: expected rows:columns:k_step:warps"):
            mm.parse_warp_tile(bad)


def test_warp_tile_keeps_the_weights_k_chunks(monkeypatch):
    """The warp tile takes the weight's K chunks; where its K steps would cross them, calls of its rows
    run the tile they would without it."""
    cpu = torch.device("cpu")  # 64-deep steps across 32-key chunks:
    assert mm.warp_tile(mm.parse_warp_tile("16:16:64:1:2"), CHUNK_TILE, 37, 100, torch.float16, cpu) is None
    assert mm.warp_tile(mm.parse_warp_tile("16:64:32:1:2"), CHUNK_TILE, 37, 100, torch.float16, cpu) == \
        mm.Tile(16, 64, 32, 1, 2, CHUNK_TILE.group_m, CHUNK_TILE.chunk_k)


def test_warp_tile_serves_the_layers_whose_decode_tile_is_as_narrow(monkeypatch):
    """Where the weight has sm90's wgmma decode tiles, the warp tile replaces only those no wider than
    its columns (the 1B shape on 132 SMs: o_proj and down at 16 columns, not qkv at 32 nor gate/up at
    128); with no wgmma tile to compare (fp32, other GPUs, the interpreter) it serves every weight."""
    warp = mm.SM90_WARP_TILE
    monkeypatch.setattr(mm, "num_sms", lambda device: 132)
    main, cpu, bf16 = mm.Tile(64, 128, 128, 4, 4, 8), torch.device("cpu"), torch.bfloat16
    assert mm.warp_tile(warp, main, 2048, 8192, bf16, cpu) == mm.Tile(16, 16, 256, 2, 4, 8)  # no wgmma here
    monkeypatch.setattr(mm, "_sm90_wgmma", lambda dtype, device: True)
    for n, k in ((2048, 2048), (2048, 8192)):  # o_proj, down
        assert mm.decode_tile(main, n, k, bf16, cpu).block_n == 16
        assert mm.warp_tile(warp, main, n, k, bf16, cpu) == mm.Tile(16, 16, 256, 2, 4, 8)
    assert mm.decode_tile(main, 3072, 2048, bf16, cpu).block_n == 32
    assert mm.warp_tile(warp, main, 3072, 2048, bf16, cpu) is None  # qkv
    assert mm.warp_tile(warp, mm.Tile(64, 256, 64, 4, 5, 8), 16384, 2048, bf16, cpu) is None  # gate/up


def test_sm90s_warp_tile_is_the_default_for_its_16_bit_calls(monkeypatch):
    """With the variable unset, 16-bit calls of at most 16 rows on sm90 run WARP_TILE_SM90 where the
    decode tile is as narrow (here 4 SMs: 64 columns narrow to 16); fp32 calls and more rows do not,
    nor calls with the decode tiles off, nor any call with no sm90 tile (the variable's tile,
    WARP_TILE, would serve them)."""
    monkeypatch.setattr(mm, "WARP_TILE", None)
    monkeypatch.setattr(mm, "WARP_TILE_SM90", mm.SM90_WARP_TILE)
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    monkeypatch.setattr(mm, "num_sms", lambda device: 4)
    w16, w32 = randn(64, 512, dtype=torch.float16), randn(64, 512)
    monkeypatch.setattr(mm, "_sm90_wgmma", lambda dtype, device: False)

    def block_m(x, w):
        return mm._PLANS[mm.plan_key(x, w, None, mm.matmul(x, w))].main.consts["BLOCK_M"]

    assert block_m(randn(2, 512, dtype=torch.float16), w16) == mm.BLOCK_M  # no sm90 tile on this device
    monkeypatch.setattr(mm, "_sm90_wgmma", lambda dtype, device: dtype != torch.float32)
    assert [block_m(randn(m, 512, dtype=torch.float16), w16) for m in (1, 16, 17)] == [16, 16, mm.BLOCK_M]
    assert block_m(randn(1, 512), w32) == mm.BLOCK_M
    monkeypatch.setattr(mm, "DECODE_TILES", False)  # it is one of the decode tiles
    assert block_m(randn(4, 512, dtype=torch.float16), w16) == mm.BLOCK_M
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    monkeypatch.setattr(mm, "WARP_TILE_SM90", None)  # PAGEDFLASH_MATMUL_WARP_TILE set
    assert block_m(randn(3, 512, dtype=torch.float16), w16) == mm.BLOCK_M


def test_a_forced_decode_tile_must_keep_the_sum_order(monkeypatch):
    monkeypatch.setattr(mm, "WARP_TILE_SM90", None)
    monkeypatch.setattr(mm, "DECODE_TILES", True)
    monkeypatch.setattr(mm, "TILE", WIDE_TILE)
    for other in (NARROW_TILE._replace(chunk_k=32), NARROW_TILE._replace(warps=8), NARROW_TILE._replace(block_m=32)):
        monkeypatch.setattr(mm, "DECODE_TILE", other)
        with pytest.raises(ValueError, match=r"matmul.DECODE_TILE: expected .* \(only block_n, block_k and stages"):
            mm.matmul(randn(3, 64), randn(5, 64))


def test_m_is_not_specialized():
    """One compiled kernel for every batch size: ``M`` is left out of Triton's specialization."""
    kernel = mm._matmul_kernel
    if interpreted():
        names = kernel.kwargs["do_not_specialize"]
    else:
        names = [p.name for p in kernel.params if p.do_not_specialize]
    assert names == ["M"]


def test_tile_is_chosen_without_m():
    """Everything the launch configuration reads: the weight's shape, the dtype and the device."""
    assert list(inspect.signature(mm.tile).parameters) == ["n", "k", "dtype", "device"]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for n, k in [(1, 1), (37, 100), *LLAMA_8B.values()]:
            t = mm.tile(n, k, dtype, DEVICE)
            assert t.block_m == mm.BLOCK_M == 64 and t.warps == 4
            assert 16 <= t.block_n <= 256 and 16 <= t.block_k <= 128


# ---------------------------------------------------------------------------------------------- gated
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("m", [1, 5, 65, 130])
@pytest.mark.parametrize("tile", [None, SMALL_TILE, CHUNK_TILE], ids=["table", "small_tile", "chunked"])
@pytest.mark.parametrize("bias,use_out", [(True, False), (False, True)], ids=["bias", "out"])
def test_gated_matches_reference_and_the_unfused_bits(per_element_dot, monkeypatch, dtype, act, m, tile, bias, use_out):
    """``matmul(x, gate_up_weight, act=...)``: against the reference, and bit for bit the plain GEMM's
    product through the activation kernel (the K chunks, which the gated form never splits, and
    several tiles a program included; 37 outputs: a ragged last tile)."""
    monkeypatch.setattr(mm, "TILE", tile)
    monkeypatch.setattr(mm, "num_sms", lambda device: 16)  # chunked: the plain form splits 1 and 5 rows
    x, w = in_wider_rows(randn(m, 100, dtype=dtype)), in_wider_rows(randn(74, 100, dtype=dtype) * 0.3)
    b = randn(74, dtype=dtype) if bias else None
    if use_out:
        buf = torch.full((m + 1, 40), 7.0, dtype=dtype, device=DEVICE)
        out = buf[:m, :37].fill_(float("nan"))
        assert mm.matmul(x, w, b, act=act, out=out) is out
        assert (buf[:, 37:] == 7).all() and (buf[m] == 7).all()
    else:
        out = mm.matmul(x, w, b, act=act)
    assert out.dtype == dtype and out.shape == (m, 37)
    assert_close(out, ref.matmul_ref(x, w, b, act=act), dtype)
    assert torch.equal(bits(out), bits(activation.act_mul(mm.matmul(x, w, b), act)))


@pytest.mark.parametrize("tile", [SMALL_TILE, "decode", "rows"], ids=["small_tile", "decode_tiles", "row_tiles"])
def test_gated_rows_are_batch_invariant(per_element_dot, monkeypatch, tile):
    """A row alone and among 7 has the bits it has among 130, through tiles that follow M (decode: 1
    and 7 rows the narrow tile, 130 the wide one; rows: 130 rows the 32-row tile of 8 warps)."""
    monkeypatch.setattr(mm, "DECODE_TILES", tile == "decode")
    monkeypatch.setattr(mm, "ROW_TILES", tile == "rows")
    if tile == "decode":
        monkeypatch.setattr(mm, "DECODE_TILE", NARROW_TILE)
    if tile == "rows":
        monkeypatch.setattr(mm, "TALL_TILE", TALL_TILE)
        monkeypatch.setattr(mm, "num_sms", lambda device: 4)
    monkeypatch.setattr(mm, "TILE", tile if isinstance(tile, mm.Tile) else WIDE_TILE)
    x, w, b = randn(130, 100), randn(74, 100) * 0.3, randn(74)
    full = mm.matmul(x, w, b, act="silu")
    for i in (0, 6, 64, 129):
        assert torch.equal(bits(mm.matmul(x[i:i + 1], w, b, act="silu")[0]), bits(full[i])), f"row {i} alone"
        batch = randn(7, 100)
        batch[3] = x[i]
        assert torch.equal(bits(mm.matmul(batch, w, b, act="silu")[3]), bits(full[i])), f"row {i} among 7"


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_the_invariant_mlp_runs_its_activation_in_the_gate_up_epilogue(per_element_dot, monkeypatch, act):
    """The engine's batch-invariant MLP (``layers.mlp``): two GEMM launches, the bits of the gate/up
    GEMM, the activation kernel and the down GEMM."""
    from pagedflash.engine import layers
    from pagedflash.engine.models.common import RMSNorm

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Linear(48, 74, device=DEVICE).requires_grad_(False)
            self.down_proj = torch.nn.Linear(37, 48, device=DEVICE).requires_grad_(False)
            self.act = act

    monkeypatch.setattr(layers, "FORCE_KERNELS", True)
    module = MLP()
    for linear in (module.gate_up_proj, module.down_proj):
        linear.batch_invariant = True
    x = randn(3, 48)
    gate_up = mm.matmul(x, module.gate_up_proj.weight, module.gate_up_proj.bias)
    want = mm.matmul(activation.act_mul(gate_up, act), module.down_proj.weight, module.down_proj.bias)

    def unfused(*args):
        raise AssertionError("the activation kernel ran")

    for name in ("act_mul", "silu_mul", "gelu_tanh_mul"):
        monkeypatch.setattr(activation, name, unfused)
        monkeypatch.setattr(layers, name, unfused, raising=False)
    assert torch.equal(bits(layers.mlp(x, module)), bits(want))
    # after the norm (the residual added first), as the pre-norm decoder layers call it
    norm, residual = RMSNorm(48, 1e-6).to(DEVICE).requires_grad_(False), randn(3, 48)
    normed, summed = norm(x, residual)
    out, stream = layers.norm_mlp(x, residual, norm, module)
    assert torch.equal(bits(stream), bits(summed)) and torch.equal(bits(out), bits(layers.mlp(normed, module)))


# ---------------------------------------------------------------------------------------------- errors
def _errors():
    x, w = randn(3, 8), randn(4, 8)
    yield lambda: mm.matmul(randn(8), w), ValueError, r"x: expected a 2-D tensor, got 1-D"
    yield (lambda: mm.matmul(x.double(), w), TypeError,
           r"x: expected dtype in \['torch.float16', 'torch.bfloat16', 'torch.float32'\], got torch.float64")
    yield lambda: mm.matmul(randn(8, 3).t(), w), ValueError, r"x: the last dimension must be contiguous"
    yield lambda: mm.matmul(x, "w"), TypeError, r"weight: expected a torch.Tensor, got str"
    yield lambda: mm.matmul(x, randn(4, 9)), ValueError, r"weight: expected shape \(\*, 8\), got \(4, 9\)"
    yield lambda: mm.matmul(x, randn(8, 4).t()), ValueError, r"weight: the last dimension must be contiguous"
    yield (lambda: mm.matmul(x, w.half()), TypeError,
           r"weight: expected dtype torch.float32 \(the dtype of x\), got torch.float16")
    yield (lambda: mm.matmul(x, torch.empty(4, 8, device="meta")), ValueError,
           rf"weight: expected a tensor on {x.device} \(where x is\), got one on meta")
    yield lambda: mm.matmul(x, w, randn(5)), ValueError, r"bias: expected shape \(4,\), got \(5,\)"
    yield lambda: mm.matmul(x, w, randn(4).half()), TypeError, r"bias: expected dtype torch.float32"
    yield lambda: mm.matmul(x, w, out=randn(3, 5)), ValueError, r"out: expected shape \(3, 4\), got \(3, 5\)"
    yield lambda: mm.matmul(x, w, out=randn(3, 4).half()), TypeError, r"out: expected dtype torch.float32"
    yield lambda: mm.matmul(x, w, out=randn(4, 3).t()), ValueError, r"out: the last dimension must be contiguous"
    yield (lambda: mm.matmul(x, w, out=randn(1, 4).expand(3, 4)), ValueError,
           r"out: expected rows that do not overlap \(row stride >= 4\), got strides \(0, 1\)")
    square = randn(4, 4)
    yield lambda: mm.matmul(randn(4, 4), square, out=square), ValueError, r"out: shares memory with weight"
    yield lambda: mm.matmul(x.clone().requires_grad_(), w), ValueError, r"x: requires grad"
    yield lambda: mm.matmul(x, w, act="relu"), ValueError, r"act: expected None or one of \('silu', 'gelu_tanh'\), got 'relu'"
    yield (lambda: mm.matmul(x, randn(5, 8), act="silu"), ValueError,
           r"weight: expected an even number of rows with act \(gate rows, then as many up rows\), got shape \(5, 8\)")
    yield (lambda: mm.matmul(x, w, act="gelu_tanh", out=randn(3, 4)), ValueError,
           r"out: expected shape \(3, 2\), got \(3, 4\)")
    yield (lambda: mm.matmul(x, w, act="silu", out=randn(1, 2).expand(3, 2)), ValueError,
           r"out: expected rows that do not overlap \(row stride >= 2\), got strides \(0, 1\)")


@pytest.mark.parametrize("case", range(len(list(_errors()))))
def test_bad_input_is_refused_by_name(case):
    call, error, message = list(_errors())[case]
    with pytest.raises(error, match=message):
        call()


def test_host_tensors_are_refused_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(mm, "interpreted", lambda: False)
    mm._PLANS.clear()
    with pytest.raises(ValueError, match=r"x: expected a CUDA tensor \(a CPU one only under the Triton interpreter"):
        mm.matmul(torch.randn(3, 8), torch.randn(4, 8))


def test_a_signature_checked_once_still_refuses_other_inputs():
    x, w = randn(3, 8), randn(4, 8)
    mm.matmul(x, w)
    mm.matmul(x, w)  # the cached signature
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 4\)"):
        mm.matmul(x, w, out=randn(2, 4))
    with pytest.raises(ValueError, match="x: requires grad"):
        mm.matmul(x.clone().requires_grad_(), w)
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 4\)"):  # the operator called directly
        torch.ops.pagedflash.matmul(x, w, None, randn(2, 4))


# ---------------------------------------------------------------------------------------------- torch.compile
def test_operator_passes_opcheck():
    x, w = randn(5, 24), randn(12, 24)
    torch.library.opcheck(torch.ops.pagedflash.matmul.default, (x, w, randn(12), torch.empty(5, 12, device=DEVICE)),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.pagedflash.matmul.default, (x, w, None, torch.empty(5, 6, device=DEVICE), "silu"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def assert_compiles_once_with_eagers_bits(fn, n):
    """``fn(x, w [n, 100], b [n])`` through ``torch.compile(fullgraph=True, dynamic=True)``: one graph
    for 5 and 9 rows, eager's bits."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    w, b = randn(n, 100), randn(n)
    try:
        with torch.inference_mode():
            for m in (5, 9):
                x = randn(m, 100)
                assert torch.equal(bits(compiled(x, w, b)), bits(fn(x, w, b)))
        assert counter.frame_count == 1
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("tile", [None, CHUNK_TILE], ids=["table", "chunked"])
def test_compiled_is_bit_identical_and_compiles_once_for_every_m(monkeypatch, tile):
    """``torch.compile(dynamic=True, fullgraph=True)``: one graph (the operator) for two batch sizes,
    results bit-identical to eager (chunked: K = 100 in 4 chunks, the split form at 5 and 9 rows)."""
    monkeypatch.setattr(mm, "TILE", tile)
    assert_compiles_once_with_eagers_bits(lambda x, w, b: mm.matmul(x, w, b), 12)


def test_gated_compiles_without_a_graph_break():
    """``act`` through ``torch.compile(fullgraph=True, dynamic=True)``: one graph for two batch sizes,
    eager's bits."""
    assert_compiles_once_with_eagers_bits(lambda x, w, b: mm.matmul(x, w, b, act="gelu_tanh"), 24)


@pytest.mark.parametrize("tile", [None, CHUNK_TILE], ids=["table", "chunked"])
def test_eager_through_the_dispatcher_is_bit_identical(monkeypatch, tile):
    monkeypatch.setattr(mm, "TILE", tile)
    x, w, b = randn(7, 100), randn(12, 100), randn(12)
    want = mm.matmul(x, w, b)
    previous = custom_ops.dispatch_eager(True)
    try:
        assert torch.equal(bits(mm.matmul(x, w, b)), bits(want))
    finally:
        custom_ops.dispatch_eager(previous)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=ids)
@pytest.mark.parametrize("name", [*LLAMA_8B, "1b_o_proj", "1b_down"])
@pytest.mark.parametrize("tiles", ["one_tile", "decode_tiles", "row_tiles"])
def test_llama_projections(monkeypatch, name, dtype, tiles):
    """Against the reference at M = 1 and 300, and batch invariance with the real dot at M = 1, 7, 256
    and 1000 (the row in several row tiles and at several positions in its tile); with DECODE_TILES,
    M = 1 and 7 run the narrow decode tile (on sm90 the 1B's o_proj and down the warp tile, another MMA
    instruction) and the others the weight's tile: the MMA's bits must not
    depend on the tile's width or K steps (Llama-3-8B's projections; Llama-3.2-1B's o_proj and down,
    whose decode tiles take 256-deep steps); with ROW_TILES too, 4,096 rows run the 128-row tile
    of two warpgroups."""
    monkeypatch.setattr(mm, "DECODE_TILES", tiles != "one_tile")
    monkeypatch.setattr(mm, "ROW_TILES", tiles == "row_tiles")
    n, k = {**LLAMA_8B, "1b_o_proj": (2048, 2048), "1b_down": (2048, 8192)}[name]  # 1B: 16 by 256 decode tiles
    w = randn(n, k, dtype=dtype) / k**0.5
    x = randn(4096 if tiles == "row_tiles" else 1000, k, dtype=dtype)
    for m in (1, 300):
        assert_close(mm.matmul(x[:m], w), ref.matmul_ref(x[:m], w), dtype)
    check_rows_invariant(x, w, None, rows=[0, 6, 63, 64, 255, 999, x.shape[0] - 1])
    check_rows_invariant(x[:256], w, None, rows=[0, 100, 255])


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("tiles", ["one_tile", "decode_tiles", "warp_tile"])
def test_one_compiled_kernel_for_every_m(monkeypatch, tiles):
    """A weight shape no other test uses (K = 520: not a multiple of 16; N = 272 + the case's index):
    its first call of each tile compiles, no other batch size of that tile does (with DECODE_TILES,
    and the default ROW_TILES: 1,000 rows run a 64-column tile, the rows up to 65 the decode tile;
    with sm90's warp tile too, the rows up to 16 run that one)."""
    case = ["one_tile", "decode_tiles", "warp_tile"].index(tiles)
    monkeypatch.setattr(mm, "DECODE_TILES", tiles != "one_tile")
    monkeypatch.setattr(mm, "WARP_TILE", None)
    monkeypatch.setattr(mm, "WARP_TILE_SM90", mm.SM90_WARP_TILE if tiles == "warp_tile" else None)
    w = randn(272 + case, 520, dtype=torch.float16)
    kernels = mm._matmul_kernel.device_caches[torch.cuda.current_device()][0]
    launched = []
    for m in (1, 17, 1000):
        x = randn(m, 520, dtype=torch.float16)
        out = mm.matmul(x, w)
        consts = mm._PLANS[mm.plan_key(x, w, None, out)].main.consts
        launched.append((consts["BLOCK_M"], consts["BLOCK_N"]))
    compiled = len(kernels)
    sm90 = torch.cuda.get_device_capability()[0] == 9  # decode and warp tiles are sm90's
    narrow = tiles != "one_tile" and sm90
    warp = tiles == "warp_tile" and sm90
    assert (launched[1][1] < launched[2][1]) == narrow, launched
    assert (launched[0][0] == 16 != launched[1][0]) == warp, launched
    for m in (2, 3, 16, 17, 64, 65, 1000):
        mm.matmul(randn(m, 520, dtype=torch.float16), w)
    assert len(kernels) == compiled


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("tile", [None, CHUNK_TILE], ids=["table", "chunked"])
@pytest.mark.parametrize("act", [None, "silu"])
def test_cuda_graph_replay_is_bit_identical(monkeypatch, tile, act):
    """Captured into a CUDA graph (no host sync in the call) and replayed on new values of x (chunked:
    the split form's partials allocated inside the capture; with act, the gated epilogue)."""
    monkeypatch.setattr(mm, "TILE", tile)
    dtype = torch.bfloat16
    x, w, b = randn(37, 520, dtype=dtype), randn(300, 520, dtype=dtype), randn(300, dtype=dtype)
    out = torch.empty(37, 150 if act else 300, dtype=dtype, device=DEVICE)
    graph, _ = capture_graph(lambda: mm.matmul(x, w, b, act=act, out=out))  # checks and compilation outside
    x.copy_(randn(37, 520, dtype=dtype))
    graph.replay()
    assert torch.equal(bits(out), bits(mm.matmul(x, w, b, act=act)))

"""Cache writes and RoPE with invalid metadata, value checks off (the default; issue 34).

Every kind of bad value the kernels can be given: slots past the pool (``write_kv_cache``), rows
whose ``cache_seqlens + S_new`` leave the cache or whose page ids leave the pool (``append_kv``,
what ``flash_attn_with_kvcache`` runs with new k/v), positions outside the cos/sin tables
(``rope_``); huge values (2^31 - 1, 2^40) that would crash the interpreter if a kernel followed
them. The caches are views into NaN-poisoned buffers with spare pages on both sides, and x's rows
are followed by a sentinel, so the whole buffer compared bitwise with the expected one shows any
write outside its slot or outside the tensor; valid tokens are written exactly. Each call runs
without a host read of a device value (:func:`no_host_reads`); the fault buffer names the argument
and the last bad index, :func:`pagedflash.validate.raise_if_invalid` raises it once and clears it.
The debug mode (``value_checks(True)``) still refuses the same calls on the host.
"""

import contextlib
import re

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close, ids, randn

from pagedflash import flash_attn_with_kvcache, validate, write_kv_cache
from pagedflash import reference as ref
from pagedflash.ops import rope
from pagedflash.ops.cache_write import append_kv

HKV, D = 2, 32
SPARE = 2  # poisoned pages (rows) on each side of a cache


@pytest.fixture(autouse=True)
def clean_faults():
    validate.invalid_metadata()  # clears what earlier tests left
    yield
    validate.invalid_metadata()


@contextlib.contextmanager
def no_host_reads():
    """Every way the host reads a device value (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``,
    ``float(t)``, an index) raises inside: the default path must not synchronize."""
    names = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"a device value was read on the host (Tensor.{name})")
        return read

    with pytest.MonkeyPatch.context() as mp:
        for name in names:
            mp.setattr(torch.Tensor, name, refuse(name))
        yield


def assert_faults(**expected: int) -> None:
    """The fault buffer holds exactly ``argument name -> last bad index``; raise_if_invalid raises a
    ValueError naming each, then the record is clear."""
    messages = validate.invalid_metadata(DEVICE, clear=False)
    got = {m.split(":", 1)[0]: int(re.search(r"found (?:sequence|token) (\d+) invalid", m).group(1)) for m in messages}
    assert got == expected
    if expected:
        with pytest.raises(ValueError, match="invalid metadata: " + ".*".join(re.escape(n) for n in got)):
            validate.raise_if_invalid(DEVICE)
    validate.raise_if_invalid(DEVICE)  # cleared
    assert validate.invalid_metadata(DEVICE) == []


def poisoned(pages: int, page_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, cache)``: a cache ``[pages, page_size, HKV, D]`` of random values, a view into a
    buffer with :data:`SPARE` NaN pages on each side (fp8: the format's NaN)."""
    buf = torch.full((pages + 2 * SPARE, page_size, HKV, D), float("nan"), device=DEVICE)
    buf[SPARE:-SPARE] = randn(pages, page_size, HKV, D)
    buf = buf.to(dtype)
    return buf, buf[SPARE:-SPARE]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (bits(actual) != bits(expected)).reshape(actual.shape[0], -1).any(-1)
    assert not diff.any(), f"{what}: pages/rows {diff.nonzero().flatten().tolist()} differ from the expected bits"


# ---------------------------------------------------------------- write_kv_cache (by slot)


def write_case(cache_dtype, new_dtype, slot_values, *, pages=3, page_size=4, **scales):
    """Write len(slot_values) random tokens by slot; compare both whole buffers with the reference
    write of the valid slots (the others as -1: not written)."""
    (kbuf, k_cache), (vbuf, v_cache) = poisoned(pages, page_size, cache_dtype), poisoned(pages, page_size, cache_dtype)
    want_k, want_v = kbuf.clone(), vbuf.clone()
    k, v = randn(len(slot_values), HKV, D, dtype=new_dtype), randn(len(slot_values), HKV, D, dtype=new_dtype)
    slots = torch.tensor(slot_values, dtype=torch.int64, device=DEVICE)
    with no_host_reads():
        write_kv_cache(k, v, k_cache, v_cache, slots, **scales)
    capacity = pages * page_size
    valid = torch.tensor([s if s < capacity else -1 for s in slot_values], dtype=torch.int64, device=DEVICE)
    ref.write_kv_cache_ref(k, v, want_k[SPARE:-SPARE], want_v[SPARE:-SPARE], valid, **scales)
    assert_same_bits(kbuf, want_k, "k_cache")
    assert_same_bits(vbuf, want_v, "v_cache")


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_slots_past_the_pool_write_nothing(dtype):
    # capacity 12: 12 and 13 would land in the spare page after the pool, 2**40 far outside it
    write_case(dtype, dtype, [0, 12, 5, -1, 2**40, 11, 13, 7])
    assert_faults(slot_mapping=6)
    write_case(dtype, dtype, [3, -7, 11, 4])  # padding only: no fault
    assert_faults()


def test_fp8_cache_slots_past_the_pool_write_nothing():
    scale = torch.tensor([0.5, 2.0], device=DEVICE)
    write_case(torch.float8_e4m3fn, torch.float16, [2**40, 9, 12, 0, -1], k_scale=scale, v_scale=scale[:1])
    assert_faults(slot_mapping=2)


# ---------------------------------------------------------------- append (flash_attn_with_kvcache's k/v)


def append_case(dtype, seqlens, s_new, *, table=None, pages=None, page_size=4):
    """Append s_new tokens per row at cache_seqlens; dense (``table`` None: rows of ``page_size``
    slots) or paged. Expected: rows whose positions fit write every token whose page id is in the
    pool; nothing else changes."""
    batch = len(seqlens)
    pages = batch if table is None else pages
    (kbuf, k_cache), (vbuf, v_cache) = poisoned(pages, page_size, dtype), poisoned(pages, page_size, dtype)
    want_k, want_v = kbuf.clone(), vbuf.clone()
    k, v = randn(batch, s_new, HKV, D, dtype=dtype), randn(batch, s_new, HKV, D, dtype=dtype)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    block_table = None if table is None else torch.tensor(table, dtype=torch.int32, device=DEVICE)
    with no_host_reads():
        append_kv(k, v, k_cache, v_cache, cache_seqlens, block_table)
    capacity = page_size if table is None else len(table[0]) * page_size
    slots = []
    for b, n in enumerate(seqlens):
        for t in range(s_new):
            pos = n + t
            page = b if table is None else table[b][pos // page_size] if 0 <= n and n + s_new <= capacity else -1
            fits = 0 <= n and n + s_new <= capacity and 0 <= page < pages
            slots.append(page * page_size + pos % page_size if fits else -1)
    ref.write_kv_cache_ref(k.flatten(0, 1), v.flatten(0, 1), want_k[SPARE:-SPARE], want_v[SPARE:-SPARE],
                           torch.tensor(slots, dtype=torch.int64, device=DEVICE))
    assert_same_bits(kbuf, want_k, "k_cache")
    assert_same_bits(vbuf, want_v, "v_cache")


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_append_past_a_dense_cache_writes_nothing_of_the_row(dtype):
    # S_max 6, 3 new tokens: rows 0 and 3 fit; 1 ends one past the cache, 2 starts before it,
    # 4 overflows int32 when the tokens are added, 5 is far past the cache
    append_case(dtype, [0, 4, -1, 3, 2**31 - 2, 2**30], 3, page_size=6)
    assert_faults(cache_seqlens=5)
    append_case(dtype, [5, 0], 1, page_size=6)  # the last slot exactly
    assert_faults()


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_append_through_bad_page_ids_writes_nothing_there(dtype):
    # pool of 6 pages of 4, tables of 3 columns (capacity 12), 2 new tokens per row: row 0 valid;
    # row 1's second token lands in page -1 (its first, in page 4, is written); row 2's page is
    # the pool's size; row 3's 2**31 - 1; row 4 is past the table (a length fault, its bad ids unread);
    # row 5 reaches the table's last slot through valid pages
    table = [[0, 1, 2], [4, -1, 3], [5, 6, 5], [2**31 - 1, 0, 0], [1, 1, -9], [3, 5, 2]]
    append_case(dtype, [2, 3, 4, 0, 11, 10], 2, table=table, pages=6)
    assert_faults(block_table=3, cache_seqlens=4)


def test_fp8_append_past_the_cache_writes_nothing():
    append_case(torch.float8_e5m2, [1, 3], 2, page_size=4)
    assert_faults(cache_seqlens=1)


# ---------------------------------------------------------------- RoPE


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("bad", [[-1, 16, 2**31 - 1], [-(2**40), 2**40, 16]], ids=["int32", "int64"])
def test_rope_positions_outside_the_tables_give_nan_rows(dtype, bad):
    """Rows of 3 rotated heads then one left alone, followed by a sentinel; rows 1, 3 and 4 have bad
    positions: their rotated heads become NaN, everything else is exactly what a valid call gives."""
    num_heads, head_dim, max_len, width, sentinel = 3, 20, 16, 80, 7.25
    pos_dtype = torch.int32 if max(abs(p) for p in bad) < 2**31 else torch.int64
    positions = [5, bad[0], 0, bad[1], bad[2], 15]
    bad_rows = [1, 3, 4]
    buf = torch.full((len(positions) + 1, width + 3), sentinel, dtype=dtype, device=DEVICE)
    buf[:-1, :width] = randn(len(positions), width, dtype=dtype)
    x = buf[:-1, :width]
    cos, sin = randn(max_len, head_dim), randn(max_len, head_dim)
    good = torch.tensor([0 if r in bad_rows else p for r, p in enumerate(positions)], dtype=pos_dtype, device=DEVICE)
    want = buf.clone()
    rope.rope_(want[:-1, :width], good, cos, sin, num_heads=num_heads, head_dim=head_dim)
    rotated = num_heads * head_dim
    want[bad_rows, :rotated] = float("nan")
    assert_close(want[[0, 2, 5], :width], ref.rope_ref(x, good, cos, sin, num_heads, head_dim)[[0, 2, 5]], dtype)
    pos = torch.tensor(positions, dtype=pos_dtype, device=DEVICE)
    with no_host_reads():
        rope.rope_(x, pos, cos, sin, num_heads=num_heads, head_dim=head_dim)
    assert buf[bad_rows, :rotated].isnan().all()
    assert_same_bits(torch.nan_to_num(buf), torch.nan_to_num(want), "x")
    assert_faults(positions=4)


def test_rope_cached_signature_still_reads_no_value_and_reports():
    x, cos = randn(2, 40), randn(8, 20)
    for positions in ([0, 7], [9, 1], [3, -1]):  # one signature: the first call plans, the others reuse it
        with no_host_reads():
            rope.rope_(x, torch.tensor(positions, device=DEVICE), cos, cos, num_heads=2, head_dim=20)
        bad = [i for i, p in enumerate(positions) if not 0 <= p < 8]
        assert x[bad].isnan().all() and not x[[i for i in range(2) if i not in bad]].isnan().any()
        assert_faults(**({"positions": bad[-1]} if bad else {}))
        x = randn(2, 40)


def test_rope_structure_is_checked_by_default():
    """Value checks off: a signature's first call still checks shapes, dtypes and devices, and a
    call differing from a cached signature in one of them is a new signature, checked again."""
    x, pos, table = randn(2, 40), torch.tensor([0, 5], device=DEVICE), randn(16, 20)
    assert not validate.value_checks_enabled(x)
    rope.rope_(x, pos, table, table, num_heads=2, head_dim=20)
    with pytest.raises(TypeError, match=r"cos: expected dtype in \['torch.float32'\]"):
        rope.rope_(x, pos, table.half(), table, num_heads=2, head_dim=20)
    with pytest.raises(ValueError, match="sin: expected the shape of cos"):
        rope.rope_(x, pos, table, table[:15], num_heads=2, head_dim=20)
    with pytest.raises(ValueError, match=r"positions: expected shape \(2,\)"):
        rope.rope_(x, pos[:1], table, table, num_heads=2, head_dim=20)
    with pytest.raises(TypeError, match="positions: expected dtype in"):
        rope.rope_(x, pos.float(), table, table, num_heads=2, head_dim=20)
    assert_faults()


# ---------------------------------------------------------------- valid calls, the debug mode


def test_valid_calls_leave_the_fault_buffer_clean():
    write_case(torch.float32, torch.float32, [0, 11, -1, 6])
    append_case(torch.float32, [0, 4], 2, page_size=6)
    append_case(torch.float32, [10, 0], 2, table=[[2, 0, 1], [3, 4, 5]], pages=6)
    x, cos = randn(3, 40), randn(8, 20)
    rope.rope_(x, torch.tensor([0, 7, 3], device=DEVICE), cos, cos, num_heads=2, head_dim=20)
    assert not x.isnan().any()
    assert_faults()


def test_the_debug_mode_refuses_on_the_host_and_writes_nothing():
    kbuf, k_cache = poisoned(3, 4, torch.float32)
    vbuf, v_cache = poisoned(3, 4, torch.float32)
    before = kbuf.clone(), vbuf.clone()
    k = randn(2, HKV, D)
    x, cos = randn(2, 40), randn(16, 20)
    x_before = x.clone()
    q = randn(2, 1, 4, D)
    with validate.value_checks(True):
        with pytest.raises(ValueError, match=r"slot_mapping: slots must be < num_blocks \* page_size = 12, got 12"):
            write_kv_cache(k, k, k_cache, v_cache, torch.tensor([0, 12], device=DEVICE))
        with pytest.raises(ValueError, match=r"positions: expected values in \[0, 16\) \(rows of cos/sin\), got values in \[-1, 3\]"):
            rope.rope_(x, torch.tensor([3, -1], device=DEVICE), cos, cos, num_heads=2, head_dim=20)
        with pytest.raises(ValueError, match="cache_seqlens"):
            flash_attn_with_kvcache(q, k_cache[:2], v_cache[:2], k=k[:, None], v=k[:, None],
                                    cache_seqlens=torch.tensor([4, 0], dtype=torch.int32, device=DEVICE))
    assert_same_bits(kbuf, before[0], "k_cache")
    assert_same_bits(vbuf, before[1], "v_cache")
    assert torch.equal(x, x_before)
    assert_faults()

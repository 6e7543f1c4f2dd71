"""Block manager: unit tests for every method and error, and prefix caching (the stateful random
test is in test_block_manager_stateful.py). ``check_invariants`` is asserted after every step, as in
vLLM's prefix-caching tests."""

import math

import numpy
import pytest
from helpers import check_invariants, snapshot

from pagedflash.cache import block_manager as bm_module
from pagedflash.cache.block_manager import BlockManager, NoFreeBlocksError, chain_hash


def run(bm: BlockManager, seq_id, tokens):
    """allocate, then the forward that writes the new K/V completes: commit every token."""
    table, cached = bm.allocate(seq_id, tokens)
    bm.commit(seq_id, len(tokens))
    return table, cached


def append(bm: BlockManager, seq_id, token):
    """append_token, then its forward completes."""
    table = bm.append_token(seq_id, token)
    bm.commit(seq_id, bm.num_tokens(seq_id))
    return table


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=0, page_size=4), "num_blocks must be an int >= 1, got 0"),
        (dict(num_blocks=4, page_size=0), "page_size must be an int >= 1, got 0"),
        (dict(num_blocks=4, page_size=2.0), "page_size must be an int >= 1, got 2.0"),
        (dict(num_blocks=True, page_size=2), "num_blocks must be an int >= 1, got True"),
    ],
    ids=["zero-blocks", "zero-page", "float-page", "bool-blocks"],
)
def test_constructor_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**kwargs)


def test_fresh_manager():
    bm = BlockManager(5, 3)
    assert bm.num_free_blocks == 5 and bm.num_blocks == 5 and bm.page_size == 3
    assert bm.stats.hit_rate == 0.0
    check_invariants(bm)


# ----------------------------------------------------------------------------- allocate / free


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_allocate_and_free(page_size):
    bm = BlockManager(8, page_size)
    tokens = list(range(7))
    table, cached = bm.allocate("a", tokens)
    assert cached == 0 and len(table) == math.ceil(7 / page_size) and len(set(table)) == len(table)
    assert bm.block_table("a") == table and bm.num_tokens("a") == 7 and "a" in bm
    assert bm.num_free_blocks == 8 - len(table)
    assert all(bm.ref_count(b) == 1 for b in table)
    check_invariants(bm)
    bm.free("a")
    assert "a" not in bm and bm.num_free_blocks == 8 and all(bm.ref_count(b) == 0 for b in table)
    check_invariants(bm)


def test_block_table_is_a_copy():
    bm = BlockManager(4, 2)
    table, _ = bm.allocate(0, [1, 2, 3])
    table.append(99)
    bm.block_table(0).append(98)
    assert len(bm.block_table(0)) == 2


def test_allocate_errors():
    bm = BlockManager(2, 2)
    with pytest.raises(ValueError, match="token_ids must hold at least one token .* got 0"):
        bm.allocate(0, [])
    bm.allocate(0, [1])
    with pytest.raises(ValueError, match="seq_id 0 is already allocated"):
        bm.allocate(0, [1])
    before = snapshot(bm)
    with pytest.raises(
        NoFreeBlocksError, match=r"needs 2 new blocks for 4 tokens \(0 cached\), but only 1 are free"
    ):
        bm.allocate(1, [5, 6, 7, 8])
    assert snapshot(bm) == before
    assert issubclass(NoFreeBlocksError, RuntimeError)


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
def test_token_ids_are_checked_before_any_change(caching):
    bm = BlockManager(4, 2, enable_prefix_caching=caching)
    for bad, exc, match in ((1.0, TypeError, r"token_ids\[1\] must be an int token id, got 1.0 of type float"),
                            (True, TypeError, r"token_ids\[1\] must be an int token id, got True"),
                            (-1, ValueError, r"token_ids\[1\] must be a token id in \[0, 2\*\*63\), got -1"),
                            (2**63, ValueError, r"token_ids\[1\] must be a token id in \[0, 2\*\*63\)"),
                            (2**64 - 1, ValueError, r"token_ids\[1\] must be a token id in \[0, 2\*\*63\)"),
                            (2**64, ValueError, r"token_ids\[1\] must be a token id in \[0, 2\*\*63\)"),
                            (-(2**70), ValueError, r"token_ids\[1\] must be a token id in \[0, 2\*\*63\)")):
        before = snapshot(bm)
        with pytest.raises(exc, match=match):
            bm.allocate(0, [1, bad])
        assert snapshot(bm) == before and 0 not in bm
    big = [2**63 - 1, 0, 2**62, 255]  # the largest int64, and ids whose bytes are 0x00 or 0xff
    bm.allocate(9, big + [1])
    bm.commit(9, 5)
    bm.free(9)
    assert bm.allocate(8, [numpy.int64(t) for t in big] + [2])[1] == (4 if caching else 0)  # numpy ids hit
    bm.free(8)
    bm.allocate(0, [1])
    bm.append_token(0, 2**63 - 1)  # the largest int64 is a valid id
    for bad, exc in ((2.5, TypeError), (2**63, ValueError), (-5, ValueError), (None, TypeError)):
        before = snapshot(bm)
        with pytest.raises(exc, match="token_id must be"):
            bm.append_token(0, bad)  # with caching on, 2**63 used to change num_tokens, then overflow
        assert snapshot(bm) == before and bm.num_tokens(0) == 2
    bm.commit(0, 2)
    check_invariants(bm)


def test_unknown_seq_errors():
    bm = BlockManager(2, 2)
    bm.allocate("x", [1])
    bm.free("x")
    for call in (bm.free, bm.block_table, bm.num_tokens, bm.can_append, lambda s: bm.append_token(s, 1),
                 bm.reserve_block, bm.release_reserved):
        with pytest.raises(ValueError, match="unknown seq_id 'x': never allocated or already freed"):
            call("x")


def test_can_allocate():
    bm = BlockManager(3, 4)
    assert bm.can_allocate(12) and not bm.can_allocate(13)
    bm.allocate(0, [1] * 5)
    assert bm.can_allocate(4) and not bm.can_allocate(5)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1, got 0"):
        bm.can_allocate(0)


def test_blocks_are_never_handed_out_twice():
    bm = BlockManager(6, 1, enable_prefix_caching=False)
    tables = [bm.allocate(i, [i, i])[0] for i in range(3)]
    assert len({b for t in tables for b in t}) == 6
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(3, [0])


# ----------------------------------------------------------------------------- append_token


def test_append_token_fills_then_grows():
    bm = BlockManager(4, 2)
    table, _ = bm.allocate(0, [1])
    assert bm.can_append(0)
    assert bm.append_token(0, 2) == table  # fills block 0, no new block
    assert bm.block_hash(table[0]) is None  # full, but its K/V are not committed yet
    bm.commit(0, 2)
    assert bm.block_hash(table[0]) == chain_hash(None, [1, 2])
    assert bm.num_free_blocks == 3
    grown = bm.append_token(0, 3)
    assert grown[:1] == table and len(grown) == 2 and bm.num_free_blocks == 2
    bm.commit(0, 3)
    assert bm.block_hash(grown[1]) is None  # partial
    bm.append_token(0, 4)
    bm.commit(0, 4)
    assert bm.block_hash(grown[1]) == chain_hash(chain_hash(None, [1, 2]), [3, 4])
    assert bm.num_tokens(0) == 4 and bm.num_committed_tokens(0) == 4
    check_invariants(bm)


def test_append_token_exhausted():
    bm = BlockManager(1, 2)
    bm.allocate(0, [1, 2])
    assert not bm.can_append(0)
    before = snapshot(bm)
    with pytest.raises(
        NoFreeBlocksError, match=r"append_token\(seq_id=0\) needs a new block, but none of the 1"
    ):
        bm.append_token(0, 3)
    assert snapshot(bm) == before


def test_reserve_block_ahead_of_the_token():
    """A step launched ahead writes its token's K/V before the token is known: the block comes first,
    append_token fills it, and a reservation no token reached goes back to the pool."""
    bm = BlockManager(4, 2)
    table, _ = bm.allocate(0, [1])
    assert bm.reserve_block(0) == table  # the last block has room: nothing to reserve
    bm.append_token(0, 2)
    grown = bm.reserve_block(0)
    assert grown[:1] == table and len(grown) == 2 and bm.num_free_blocks == 2
    assert bm.reserve_block(0) == grown  # reserved already
    check_invariants(bm)
    assert bm.append_token(0, 3) == grown and bm.num_free_blocks == 2  # fills the reserved block
    assert bm.release_reserved(0) == grown  # a token reached it: kept
    bm.append_token(0, 4)
    reserved = bm.reserve_block(0)
    assert bm.release_reserved(0) == grown and bm.num_free_blocks == 2
    assert bm.allocate(1, [5])[0] == reserved[2:]  # handed out next, as before the reservation
    check_invariants(bm)
    bm.commit(0, 4)  # committing the tokens never touches a reserved block
    bm.reserve_block(0)
    bm.commit(0, 4)
    assert bm.block_hash(bm.block_table(0)[2]) is None
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 4
    check_invariants(bm)


def test_reserve_block_exhausted():
    bm = BlockManager(1, 2)
    bm.allocate(0, [1, 2])
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match=r"reserve_block\(seq_id=0\) needs a new block, but none of the 1"):
        bm.reserve_block(0)
    assert snapshot(bm) == before


# ----------------------------------------------------------------------------- commit


def test_uncommitted_blocks_are_never_hit():
    bm = BlockManager(8, 2)
    a, _ = bm.allocate("a", [1, 2, 3, 4, 5])
    assert bm.allocate("b", [1, 2, 3, 4, 6])[1] == 0  # a's K/V are not written yet
    bm.commit("a", 2)  # the first block's forward completed
    assert bm.block_hash(a[0]) is not None and bm.block_hash(a[1]) is None
    assert bm.num_committed_tokens("a") == 2
    table, cached = bm.allocate("c", [1, 2, 3, 4, 6])
    assert cached == 2 and table[0] == a[0] and table[1] != a[1]
    check_invariants(bm)


def test_freed_uncommitted_blocks_go_back_uncached():
    """A forward that failed: its blocks were handed out and maybe half written, never committed."""
    bm = BlockManager(4, 2)
    a, _ = bm.allocate("a", [1, 2, 3, 4, 5])
    bm.commit("a", 3)  # block 0 committed; block 1 full but its forward failed
    bm.free("a")
    assert bm.block_hash(a[1]) is None and a[1] in bm._free_uncached and a[0] in bm._evictable
    assert bm.allocate("b", [1, 2, 3, 4, 5])[1] == 2
    check_invariants(bm)


def test_commit_is_monotone_and_checked():
    bm = BlockManager(8, 2)
    table, _ = bm.allocate("a", [1, 2, 3, 4, 5])
    bm.commit("a", 4)
    before = snapshot(bm)
    bm.commit("a", 1)  # fewer than before: nothing changes
    bm.commit("a", 5)  # the partial block is never registered
    assert snapshot(bm) == before and bm.num_committed_tokens("a") == 4
    for bad, match in ((6, "num_tokens must be at most the 5 tokens seq_id 'a' holds, got 6"),
                       (-1, "num_tokens must be an int >= 0, got -1"), (2.0, "num_tokens must be an int >= 0"),
                       (True, "num_tokens must be an int >= 0, got True")):
        with pytest.raises(ValueError, match=match):
            bm.commit("a", bad)
    assert snapshot(bm) == before
    with pytest.raises(ValueError, match="unknown seq_id 'z'"):
        bm.commit("z", 1)
    off = BlockManager(8, 2, enable_prefix_caching=False)
    off.allocate("a", [1, 2, 3])
    off.commit("a", 3)
    assert off.num_committed_tokens("a") == 0 and off.block_hash(off.block_table("a")[0]) is None
    check_invariants(bm)
    check_invariants(off)


# ----------------------------------------------------------------------------- prefix caching


def test_shared_prefix_shares_blocks_and_counts_refs():
    bm = BlockManager(10, 2)
    a, cached_a = run(bm, "a", [1, 2, 3, 4, 5])
    b, cached_b = run(bm, "b", [1, 2, 3, 4, 9, 9])
    assert cached_a == 0 and cached_b == 4 and b[:2] == a[:2] and b[2] != a[2]
    assert [bm.ref_count(x) for x in a] == [2, 2, 1]
    assert bm.stats.queried_tokens == 11 and bm.stats.hit_tokens == 4
    assert bm.stats.hit_rate == pytest.approx(4 / 11)
    check_invariants(bm)
    bm.free("a")
    assert [bm.ref_count(x) for x in a] == [1, 1, 0]
    check_invariants(bm)


def test_hit_after_free_reuses_unreferenced_cached_blocks():
    bm = BlockManager(4, 2)
    a, _ = run(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    assert bm.num_free_blocks == 4  # cached blocks count as free
    b, cached = run(bm, "b", [1, 2, 3, 4, 6])
    assert cached == 4 and b[:2] == a[:2] and bm.ref_count(a[0]) == 1
    check_invariants(bm)


def test_whole_prompt_cached_recomputes_last_block():
    bm = BlockManager(8, 2)
    a, _ = run(bm, "a", [1, 2, 3, 4])
    b, cached = run(bm, "b", [1, 2, 3, 4])  # everything cached: back off one block
    assert cached == 2 and b[0] == a[0] and b[1] != a[1]
    _, cached = run(bm, "c", [1, 2, 3, 4, 5])  # both full blocks reusable, token 4 computed
    assert cached == 4
    _, cached = run(bm, "d", [1])
    assert cached == 0
    check_invariants(bm)


def test_page_size_one_never_caches_whole_prompt():
    bm = BlockManager(8, 1)
    run(bm, "a", [7, 8, 9])
    assert run(bm, "b", [7, 8, 9])[1] == 2
    assert run(bm, "c", [7])[1] == 0


def test_partial_block_never_shared():
    bm = BlockManager(8, 4)
    a, _ = run(bm, "a", [1, 2, 3])
    b, cached = run(bm, "b", [1, 2, 3, 4, 5])
    assert cached == 0 and not set(a) & set(b)
    bm.free("a")
    assert run(bm, "c", [1, 2, 3, 9])[1] == 0  # freed partial block was not cached
    check_invariants(bm)


def test_only_a_leading_run_of_blocks_hits():
    bm = BlockManager(8, 2)
    run(bm, "a", [1, 2, 3, 4, 5])
    table, cached = run(bm, "b", [9, 9, 3, 4, 5])  # block [3, 4] has another parent
    assert cached == 0 and bm.ref_count(table[1]) == 1


def test_lru_eviction_order_and_evicted_block_loses_hash():
    bm = BlockManager(4, 2)
    a, _ = run(bm, "a", [1, 2, 3, 4])
    c, _ = run(bm, "c", [5, 6])
    bm.free("a")  # freed last to first: a[1] is evicted before a[0]
    bm.free("c")
    old_hash = bm.block_hash(a[1])
    fresh, _ = run(bm, "x", [8, 8, 8])  # 1 uncached block, then evict the LRU: a[1]
    assert set(fresh) == ({0, 1, 2, 3} - set(a) - set(c)) | {a[1]}
    assert bm.block_hash(a[1]) is None and old_hash not in bm._hash_to_block
    assert run(bm, "y", [1, 2, 3, 4])[1] == 2  # a[0] still cached, a[1] evicted
    check_invariants(bm)


def test_hit_makes_a_block_most_recently_used():
    bm = BlockManager(4, 2)
    run(bm, "a", [1, 2])
    run(bm, "c", [5, 6])
    bm.free("a")
    bm.free("c")  # LRU order: a, c
    run(bm, "h", [1, 2, 9])  # hits a's block
    bm.free("h")  # LRU order: c, a
    run(bm, "x", [8] * 5)  # the two uncached blocks, then evicts c's
    bm.free("x")
    assert run(bm, "y", [1, 2, 0])[1] == 2
    bm.free("y")
    assert run(bm, "z", [5, 6, 0])[1] == 0


def test_hits_are_not_evicted_to_make_room():
    bm = BlockManager(3, 2)
    a, _ = run(bm, "a", [1, 2, 3, 4])
    c, _ = run(bm, "c", [7, 8])
    bm.free("a")
    bm.free("c")  # LRU order: a[1], a[0], c[0]; all three cached, none uncached
    b, cached = run(bm, "b", [1, 2, 3, 4, 5])
    assert cached == 4 and b == a + c  # the needed block came from c, the first non-hit
    check_invariants(bm)


def test_allocation_counting_free_hits_is_all_or_nothing():
    bm = BlockManager(3, 2)
    a, _ = run(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    run(bm, "k", [0])  # takes the uncached block; a's two blocks are free but cached
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match=r"needs 1 new blocks for 5 tokens \(2 cached\), but only 0"):
        run(bm, "b", [1, 2, 3, 4, 5])
    assert snapshot(bm) == before


def test_append_registered_block_is_hit_later():
    bm = BlockManager(8, 2)
    run(bm, "a", [1])
    append(bm, "a", 2)
    append(bm, "a", 3)
    assert run(bm, "b", [1, 2, 3])[1] == 2


def test_duplicate_full_blocks_keep_first_index_entry():
    bm = BlockManager(8, 2)
    a, _ = run(bm, "a", [1, 2, 3])
    b, _ = run(bm, "b", [1, 2, 3])
    append(bm, "a", 4)
    append(bm, "b", 4)  # same hash as a's block: b's copy is hashed but not indexed
    assert bm.block_hash(a[1]) == bm.block_hash(b[1]) and bm._hash_to_block[bm.block_hash(a[1])] == a[1]
    check_invariants(bm)
    bm.free("a")
    table, cached = run(bm, "c", [1, 2, 3, 4, 5])
    assert cached == 4 and table[1] == a[1]


def test_hash_collision_checks_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash_bytes", lambda parent_hash, data: 42)  # every block collides
    bm = BlockManager(16, 2)
    a, _ = run(bm, "a", [1, 2, 3, 4, 0])
    b, cached = run(bm, "b", [5, 6, 3, 4, 0])  # the index sends [5, 6] to a's [1, 2] block
    assert cached == 0 and not set(a) & set(b)
    assert run(bm, "c", [1, 2, 0])[1] == 2  # the indexed block itself still hits
    check_invariants(bm)


def test_hash_collision_checks_parent(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash_bytes", lambda parent_hash, data: hash(data))
    bm = BlockManager(16, 2)
    x, _ = run(bm, "x", [5, 6, 3, 4, 0])  # indexes [3, 4] computed after [5, 6]
    run(bm, "a", [1, 2, 0])
    table, cached = run(bm, "y", [1, 2, 3, 4, 0])  # [1, 2] hits; x's [3, 4] has another parent
    assert cached == 2 and x[1] not in table
    assert run(bm, "z", [3, 4, 0])[1] == 0  # nor is it a first block
    check_invariants(bm)


def test_hash_collision_checks_parent_incarnation(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash_bytes", lambda parent_hash, data: hash(data))
    bm = BlockManager(4, 2)
    a, _ = run(bm, "a", [1, 2, 3, 4])
    run(bm, "u", [7, 7, 7, 7])  # the pool is full, nothing uncached
    bm.free("a")
    bm._evictable.move_to_end(a[1])  # make the parent a[0] older than its child a[1]
    assert run(bm, "x", [5, 6])[0] == [a[0]]  # evicts a[0] and refills it as a first block
    bm.free("u")
    # a[1] follows block a[0] as it was before the eviction: its K/V saw [1, 2], not [5, 6].
    _, cached = run(bm, "y", [5, 6, 3, 4, 0])
    assert cached == 2
    check_invariants(bm)


def test_prefix_caching_disabled():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a, _ = run(bm, "a", [1, 2, 3, 4])
    b, cached = run(bm, "b", [1, 2, 3, 4, 5])
    assert cached == 0 and not set(a) & set(b)
    append(bm, "a", 5)
    append(bm, "a", 6)
    assert all(bm.block_hash(x) is None for x in bm.block_table("a"))
    bm.free("a")
    assert run(bm, "c", [1, 2, 3, 4, 5])[1] == 0
    assert bm.stats.hit_tokens == 0 and bm.stats.queried_tokens == 14
    check_invariants(bm)

"""Paged KV-cache block manager: pure Python, never touches a tensor.

The KV pool is ``num_blocks`` pages (blocks) of ``page_size`` token slots. A live sequence owns a
*block table*, the page ids holding its tokens in order: token ``i`` lives in slot
``table[i // page_size] * page_size + i % page_size``. Every block of a table but the last is full,
and ``len(table) == ceil(num_tokens / page_size)``.

Prefix caching (``enable_prefix_caching=True``)
-----------------------------------------------
- A block is *registered* when it becomes full: the prompt's full blocks at :meth:`allocate`, and
  the block an appended token completes at :meth:`append_token`. It gets the chained hash
  ``chain_hash(parent_hash, its token ids)`` (``parent_hash`` is the previous block's hash, ``None``
  for a sequence's first block) and is indexed under it, unless another block already holds that
  hash (the first one keeps the index entry; the duplicate is simply not found).
- :meth:`allocate` reuses the longest run of indexed blocks matching the prompt from its start, over
  the first ``(len(token_ids) - 1) // page_size`` blocks only: the cached prefix is a multiple of
  ``page_size`` and strictly shorter than the prompt, so at least one token is computed (when the
  whole prompt is cached, its last full block is recomputed into a fresh block).
- A hit is confirmed by content, never by hash alone: the candidate's own token ids must be equal,
  and it must have been registered right after the block matched for the previous page, in that
  block's current incarnation (block id and reuse count). By induction the whole prefix is equal,
  so a hash collision can cost a hit but never shares a wrong block.
- Reference counts: a hit raises the count, :meth:`free` lowers it. A block at count 0 is free. A
  free block with a hash stays indexed (a later prompt can still hit it) until it is handed out
  again, which *evicts* it: it loses its hash and its index entry. Free blocks without a hash are
  handed out first, then cached ones, least recently freed first. A sequence's blocks are freed
  last to first, so of one prefix the tail is evicted before the head.
- Partial blocks are never registered, hence never shared; a shared block is full and is never
  written again (an appended token goes to the sequence's own partial block or to a new block).

The K/V of every registered block must be in the pool before another sequence reads it. Blocks are
registered at :meth:`allocate`, so an engine must write a prompt's K/V no later than the forward in
which a sequence hitting it attends (true when each prompt is prefilled whole in the step it is
allocated, keys and values written before attention in every layer).
"""

from __future__ import annotations

import hashlib
import operator
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BlockManager", "NoFreeBlocksError", "PrefixCacheStats", "chain_hash"]

_HASH_BYTES = 8  # 64-bit block hashes: collisions are handled, so more bits buy nothing
_TOKEN_TYPECODE = "q"  # token ids hashed as signed 64-bit ints


class NoFreeBlocksError(RuntimeError):
    """The pool has fewer free blocks than a request needs; the manager is left unchanged."""


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters over successful :meth:`BlockManager.allocate` calls."""

    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, tokens whose K/V came from the cache

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens``, 0.0 before any query."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def chain_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block: its parent's hash (``None`` for a first block) chained with its tokens.

    Stable across processes (blake2b over the 64-bit token ids), unlike Python's ``hash``.
    """
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    if parent_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + parent_hash.to_bytes(_HASH_BYTES, "little"))
    h.update(array(_TOKEN_TYPECODE, token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class _Block:
    """One page of the pool. ``parent`` is ``(block_id, reuses)`` of the block registered before it."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent", "reuses")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent: tuple[int, int] | None = None
        self.reuses = 0  # times handed out; identifies the block's current content


class _Seq:
    __slots__ = ("token_ids", "block_table")

    def __init__(self, token_ids: list[int], block_table: list[int]):
        self.token_ids = token_ids
        self.block_table = block_table


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class BlockManager:
    """Hands out pages of a paged KV cache to sequences, with optional prefix caching.

    Args:
        num_blocks: pages in the pool (>= 1).
        page_size: token slots per page (>= 1).
        enable_prefix_caching: share full blocks between sequences with equal prefixes; with False
            nothing is hashed or shared.

    Errors: :class:`NoFreeBlocksError` when the pool is exhausted (nothing changes); ``ValueError``
    for an empty prompt, a known ``seq_id`` given to :meth:`allocate`, or an unknown one elsewhere.
    """

    def __init__(self, num_blocks: int, page_size: int, *, enable_prefix_caching: bool = True):
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("page_size", page_size)
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))  # free, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free with a hash, LRU first
        self._hash_to_block: dict[int, int] = {}
        self._seqs: dict[object, _Seq] = {}

    # ----------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, unreferenced cached blocks included."""
        return len(self._free_uncached) + len(self._evictable)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id) -> int:
        """Tokens the sequence holds (prompt plus appended)."""
        return len(self._seq(seq_id).token_ids)

    def block_table(self, seq_id) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._seq(seq_id).block_table)

    def ref_count(self, block_id: int) -> int:
        """How many live sequences hold the block."""
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> int | None:
        """The block's chained hash, ``None`` unless it is a registered full block."""
        return self._blocks[block_id].hash

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` tokens fits, counting no cache hit (conservative)."""
        _check_positive_int("num_tokens", num_tokens)
        return -(-num_tokens // self.page_size) <= self.num_free_blocks

    def can_append(self, seq_id) -> bool:
        """Whether :meth:`append_token` will succeed: the last block has room, or a block is free."""
        return not self._needs_new_block(self._seq(seq_id)) or self.num_free_blocks > 0

    # ----------------------------------------------------------------------------- updates
    def allocate(self, seq_id, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Give a new sequence the blocks for its prompt.

        Returns ``(block_ids, num_cached_tokens)``: the block table, and how many leading prompt
        tokens already have their K/V in the pool (a multiple of ``page_size``, always less than
        ``len(token_ids)``). The caller computes K/V for tokens ``num_cached_tokens`` onward.
        All or nothing: on :class:`NoFreeBlocksError` the manager is unchanged.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already allocated; free it first")
        tokens = [operator.index(t) for t in token_ids]  # plain ints (numpy / 0-d tensor ints accepted)
        if not tokens:
            raise ValueError(f"token_ids must hold at least one token for seq_id {seq_id!r}, got 0")
        p = self.page_size
        hits, hashes = self._match_prefix(tokens)
        num_needed = -(-len(tokens) // p)
        free_hits = sum(self._blocks[b].ref_count == 0 for b in hits)
        num_fresh = num_needed - len(hits)
        if num_fresh + free_hits > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"allocate(seq_id={seq_id!r}) needs {num_fresh} new blocks for {len(tokens)} tokens "
                f"({len(hits)} cached), but only {self.num_free_blocks - free_hits} are free "
                f"(num_blocks={self.num_blocks})"
            )
        for b in hits:
            self._take(b)
        table = hits + [self._allocate_block() for _ in range(num_fresh)]
        for i in range(len(hits), len(hashes)):
            self._register(table, i, tokens[i * p : (i + 1) * p], hashes[i])
        self._seqs[seq_id] = _Seq(tokens, table)
        num_cached = len(hits) * p
        self.stats.queried_tokens += len(tokens)
        self.stats.hit_tokens += num_cached
        return list(table), num_cached

    def append_token(self, seq_id, token_id: int) -> list[int]:
        """Add one token to a sequence; returns its block table (with a new block if one was needed).

        Raises :class:`NoFreeBlocksError` (nothing changed) when a new block is needed and none is
        free. A block the token completes is registered for prefix caching.
        """
        seq = self._seq(seq_id)
        token_id = operator.index(token_id)
        if self._needs_new_block(seq):
            if not self.num_free_blocks:
                raise NoFreeBlocksError(
                    f"append_token(seq_id={seq_id!r}) needs a new block, but none of the "
                    f"{self.num_blocks} blocks is free"
                )
            seq.block_table.append(self._allocate_block())
        seq.token_ids.append(token_id)
        p, n = self.page_size, len(seq.token_ids)
        if n % p == 0 and self.enable_prefix_caching:
            i, block_tokens = n // p - 1, seq.token_ids[-p:]
            parent_hash = self._blocks[seq.block_table[i - 1]].hash if i else None
            self._register(seq.block_table, i, block_tokens, chain_hash(parent_hash, block_tokens))
        return list(seq.block_table)

    def free(self, seq_id) -> None:
        """Release a sequence's blocks (last to first). Cached blocks stay reusable until evicted."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        for b in reversed(seq.block_table):
            block = self._blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_uncached.append(b)
                else:
                    self._evictable[b] = None

    # ----------------------------------------------------------------------------- internals
    def _seq(self, seq_id) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown seq_id {seq_id!r}: never allocated or already freed")
        return seq

    def _needs_new_block(self, seq: _Seq) -> bool:
        return len(seq.token_ids) % self.page_size == 0

    def _match_prefix(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Cache hits for the prompt's leading blocks, and the hashes of all its full blocks (none
        when prefix caching is off)."""
        p = self.page_size
        hits: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return hits, hashes
        max_hits = (len(tokens) - 1) // p  # leave at least one token to compute
        parent: tuple[int, int] | None = None
        for i in range(len(tokens) // p):
            block_tokens = tuple(tokens[i * p : (i + 1) * p])
            hashes.append(chain_hash(hashes[-1] if hashes else None, block_tokens))
            if len(hits) < i or i >= max_hits:
                continue  # a miss ends the cached prefix; later blocks only need their hashes
            b = self._hash_to_block.get(hashes[-1])
            if (
                b is not None
                and self._blocks[b].token_ids == block_tokens
                and self._blocks[b].parent == parent
            ):
                hits.append(b)
                parent = (b, self._blocks[b].reuses)
        return hits, hashes

    def _take(self, b: int) -> None:
        """Reference a cached block found by a prefix hit."""
        block = self._blocks[b]
        if block.ref_count == 0:
            del self._evictable[b]
        block.ref_count += 1

    def _allocate_block(self) -> int:
        """Hand out a free block: an uncached one if any, else evict the LRU cached one."""
        if self._free_uncached:
            b = self._free_uncached.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
        block = self._blocks[b]
        if block.hash is not None and self._hash_to_block.get(block.hash) == b:
            del self._hash_to_block[block.hash]
        block.hash = block.token_ids = block.parent = None
        block.reuses += 1
        block.ref_count = 1
        return b

    def _register(self, table: list[int], i: int, tokens: Sequence[int], block_hash: int) -> None:
        """Index ``table[i]``, which has just become full with ``tokens``, under ``block_hash``."""
        block = self._blocks[table[i]]
        block.hash = block_hash
        block.token_ids = tuple(tokens)
        block.parent = (table[i - 1], self._blocks[table[i - 1]].reuses) if i else None
        self._hash_to_block.setdefault(block.hash, block.block_id)

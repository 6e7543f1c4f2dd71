"""Paged KV-cache block manager: pure Python, never touches a tensor.

The KV pool is ``num_blocks`` pages (blocks) of ``page_size`` token slots. A live sequence owns a
*block table*, the page ids holding its tokens in order: token ``i`` lives in slot
``table[i // page_size] * page_size + i % page_size``. Every block of a table but the last is full,
and ``len(table) == ceil(num_tokens / page_size)``, plus one when the last block is full and
:meth:`reserve_block` gave the next token's block ahead of it.

Prefix caching (``enable_prefix_caching=True``)
-----------------------------------------------
- A block joins the prefix cache only once its K/V are in the pool: the caller reports that with
  :meth:`commit` after a forward that wrote them completed. :meth:`allocate` and
  :meth:`append_token` only hand out blocks; a block whose forward failed or never ran is never
  registered, so no later request can hit it, and on :meth:`free` it goes back uncached.
- :meth:`commit` registers every full block the committed tokens cover, in order: it gets the
  chained hash ``chain_hash(parent_hash, its token ids)`` (``parent_hash`` is the previous block's
  hash, ``None`` for a sequence's first block) and is indexed under it, unless another block
  already holds that hash (the first one keeps the index entry; the duplicate is simply not found).
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

Token ids are ints in ``[0, 2**63)`` (hashed as signed 64-bit); every update checks its arguments
before it changes anything.
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedflash.validate import check_int

__all__ = ["BlockManager", "NoFreeBlocksError", "PrefixCacheStats", "chain_hash", "chain_hash_bytes"]

_HASH_BYTES = 8  # 64-bit block hashes (Python's hash): collisions are handled, so more bits buy nothing
_TOKEN_TYPECODE, _TOKEN_BYTES = "q", 8  # token ids hashed as signed 64-bit ints
_MAX_TOKEN_ID = 2**63 - 1


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
    """Hash of a full block: its parent's hash (``None`` for a first block) chained with its tokens:
    :func:`chain_hash_bytes` of the tokens' 64-bit bytes."""
    return chain_hash_bytes(parent_hash, array(_TOKEN_TYPECODE, token_ids).tobytes())


def chain_hash_bytes(parent_hash: int | None, data: bytes) -> int:
    """:func:`chain_hash` of a block given as the bytes of its token ids as signed 64-bit ints
    (``array("q", ids).tobytes()``): the rule itself, which the manager applies to slices of one
    prompt-wide buffer (a prefix hit on a 4K-token prompt hashes 264 blocks at page 16).

    Python's hash of the bytes: SipHash, keyed once per interpreter (random unless
    ``PYTHONHASHSEED`` fixes it), so a prompt cannot be crafted to collide with another prompt's
    blocks without the key; per process, like the index it keys (nothing outside the manager sees it).
    """
    head = b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(_HASH_BYTES, "little", signed=True)
    return hash(head + data)


class _Block:
    """One page of the pool. ``parent`` is ``(block_id, reuses)`` of the block registered before it."""

    __slots__ = ("block_id", "ref_count", "hash", "token_bytes", "parent", "reuses")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_bytes: bytes | None = None  # its token ids as 64-bit ints, once registered
        self.parent: tuple[int, int] | None = None
        self.reuses = 0  # times handed out; identifies the block's current content


class _Seq:
    """A live sequence: its tokens, its block table, and how many leading blocks are committed."""

    __slots__ = ("token_ids", "block_table", "num_committed")

    def __init__(self, token_ids: list[int], block_table: list[int], num_committed: int):
        self.token_ids = token_ids
        self.block_table = block_table
        self.num_committed = num_committed  # leading blocks registered (prefix hits included)


def _token_bytes(tokens: list[int]) -> bytes | None:
    """The ints ``tokens`` as the bytes of 64-bit ints (what the block hashes read), or None when one
    is outside ``[0, 2**63)``: unsigned 64-bit refuses negatives and ints past 2**64, and the sign
    bit (the high byte's top bit) marks the ids from 2**63, so no Python pass over the ids is needed.
    For ids in range the bytes equal the signed ones :func:`chain_hash` reads."""
    try:
        data = array("Q", tokens).tobytes()
    except OverflowError:
        return None
    high = data[_TOKEN_BYTES - 1 :: _TOKEN_BYTES] if sys.byteorder == "little" else data[::_TOKEN_BYTES]
    return data if not high or max(high) < 0x80 else None


def _token_id(name: str, value) -> int:
    """``value`` as a plain int token id in ``[0, 2**63)`` (numpy / 0-d tensor ints accepted)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int token id, got {value!r}")
    try:
        token = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int token id, got {value!r} of type {type(value).__name__}") from None
    if not 0 <= token <= _MAX_TOKEN_ID:
        raise ValueError(f"{name} must be a token id in [0, 2**63), got {token}")
    return token


class BlockManager:
    """Hands out pages of a paged KV cache to sequences, with optional prefix caching.

    Args:
        num_blocks: pages in the pool (>= 1).
        page_size: token slots per page (>= 1).
        enable_prefix_caching: share full blocks between sequences with equal prefixes; with False
            nothing is hashed or shared.

    Errors (the manager is unchanged by any of them): :class:`NoFreeBlocksError` when the pool is
    exhausted; ``ValueError`` for an empty prompt, a known ``seq_id`` given to :meth:`allocate`, an
    unknown one elsewhere, or a token id outside ``[0, 2**63)``; ``TypeError`` for a token id that
    is not an int.
    """

    def __init__(self, num_blocks: int, page_size: int, *, enable_prefix_caching: bool = True):
        check_int("num_blocks", num_blocks)
        check_int("page_size", page_size)
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

    def num_committed_tokens(self, seq_id) -> int:
        """Leading tokens of the sequence whose full blocks are in the prefix cache (a multiple of
        ``page_size``; prefix hits count)."""
        return self._seq(seq_id).num_committed * self.page_size

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
        check_int("num_tokens", num_tokens)
        return -(-num_tokens // self.page_size) <= self.num_free_blocks

    def can_append(self, seq_id) -> bool:
        """Whether :meth:`append_token` will succeed: the last block has room, or a block is free."""
        return not self._needs_new_block(self._seq(seq_id)) or self.num_free_blocks > 0

    # ----------------------------------------------------------------------------- updates
    def allocate(self, seq_id, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Give a new sequence the blocks for its prompt.

        Returns ``(block_ids, num_cached_tokens)``: the block table, and how many leading prompt
        tokens already have their K/V in the pool (a multiple of ``page_size``, always less than
        ``len(token_ids)``). The caller computes K/V for tokens ``num_cached_tokens`` onward and
        reports them with :meth:`commit` once the forward that wrote them has completed.
        All or nothing: on :class:`NoFreeBlocksError` (or a bad argument) the manager is unchanged.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already allocated; free it first")
        # element checks at C speed (a type set, the bytes the hashes read); one by one only to convert
        # other int types or to name a bad id
        tokens = list(token_ids)
        if not set(map(type, tokens)) <= {int}:
            tokens = [t if type(t) is int else _token_id(f"token_ids[{i}]", t) for i, t in enumerate(tokens)]
        data = _token_bytes(tokens)
        if data is None:
            i = next(i for i, t in enumerate(tokens) if not 0 <= t <= _MAX_TOKEN_ID)
            _token_id(f"token_ids[{i}]", tokens[i])  # raises, naming it
        if not tokens:
            raise ValueError(f"token_ids must hold at least one token for seq_id {seq_id!r}, got 0")
        hits = self._match_prefix(tokens, data)
        num_needed = -(-len(tokens) // self.page_size)
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
        self._seqs[seq_id] = _Seq(tokens, table, len(hits))
        num_cached = len(hits) * self.page_size
        self.stats.queried_tokens += len(tokens)
        self.stats.hit_tokens += num_cached
        return list(table), num_cached

    def append_token(self, seq_id, token_id: int) -> list[int]:
        """Add one token to a sequence; returns its block table (with a new block if one was needed).

        Raises :class:`NoFreeBlocksError` when a new block is needed and none is free, and
        ``TypeError``/``ValueError`` for a token id that is not an int in ``[0, 2**63)``; either way
        nothing changes. The token's K/V count only once :meth:`commit` says so.
        """
        seq = self._seq(seq_id)
        if type(token_id) is not int or not 0 <= token_id <= _MAX_TOKEN_ID:
            token_id = _token_id("token_id", token_id)
        self._grow(seq, f"append_token(seq_id={seq_id!r})")
        seq.token_ids.append(token_id)
        return list(seq.block_table)

    def reserve_block(self, seq_id) -> list[int]:
        """Give a sequence the block its next token will need before the token is known (an engine
        that launches a step ahead writes that token's K/V before it reads the token); returns the
        block table. Nothing happens when the last block has room or holds the reservation already.
        Raises :class:`NoFreeBlocksError` when a block is needed and none is free (nothing changes).
        :meth:`append_token` fills the reserved block; :meth:`release_reserved` gives it back."""
        seq = self._seq(seq_id)
        self._grow(seq, f"reserve_block(seq_id={seq_id!r})")
        return list(seq.block_table)

    def release_reserved(self, seq_id) -> list[int]:
        """Free the block :meth:`reserve_block` gave the sequence if no token reached it yet (a step
        launched ahead was dropped); returns the block table."""
        seq = self._seq(seq_id)
        if len(seq.block_table) * self.page_size - len(seq.token_ids) >= self.page_size:
            b = seq.block_table.pop()
            block = self._blocks[b]
            block.ref_count -= 1  # 0: it was never shared, hashed or written by a completed forward
            self._free_uncached.appendleft(b)  # next out, as before the reservation
        return list(seq.block_table)

    def commit(self, seq_id, num_tokens: int) -> None:
        """Record that the K/V of the sequence's first ``num_tokens`` tokens are in the pool, written
        by forwards that completed: the full blocks they cover join the prefix cache.

        Call it after the forward, never before: a block committed before its K/V exist could be hit
        with wrong contents. Committing fewer tokens than before changes nothing.
        """
        seq = self._seq(seq_id)
        check_int("num_tokens", num_tokens, minimum=0)
        if num_tokens > len(seq.token_ids):
            raise ValueError(f"num_tokens must be at most the {len(seq.token_ids)} tokens seq_id {seq_id!r} "
                             f"holds, got {num_tokens}")
        if not self.enable_prefix_caching:
            return
        p = self.page_size
        for i in range(seq.num_committed, num_tokens // p):
            data = array(_TOKEN_TYPECODE, seq.token_ids[i * p : (i + 1) * p]).tobytes()
            parent_hash = self._blocks[seq.block_table[i - 1]].hash if i else None
            self._register(seq.block_table, i, data, chain_hash_bytes(parent_hash, data))
            seq.num_committed = i + 1

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
        return len(seq.token_ids) >= len(seq.block_table) * self.page_size  # full, and none reserved

    def _grow(self, seq: _Seq, caller: str) -> None:
        """Give ``seq`` a block for its next token if its last one is full (and none is reserved);
        :class:`NoFreeBlocksError` naming ``caller`` when none is free, nothing changed."""
        if self._needs_new_block(seq):
            if not self.num_free_blocks:
                raise NoFreeBlocksError(f"{caller} needs a new block, but none of the {self.num_blocks} blocks is free")
            seq.block_table.append(self._allocate_block())

    def _match_prefix(self, tokens: list[int], data: bytes) -> list[int]:
        """The indexed blocks holding the prompt's leading full blocks (none when prefix caching is
        off); ``data``: the tokens' bytes (:func:`_token_bytes`)."""
        p, w = self.page_size, self.page_size * _TOKEN_BYTES
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        parent_hash: int | None = None
        parent: tuple[int, int] | None = None
        for i in range((len(tokens) - 1) // p):  # leave at least one token to compute
            block_data = data[i * w : (i + 1) * w]
            parent_hash = chain_hash_bytes(parent_hash, block_data)
            b = self._hash_to_block.get(parent_hash)
            if b is None or self._blocks[b].token_bytes != block_data or self._blocks[b].parent != parent:
                break  # a miss ends the cached prefix
            hits.append(b)
            parent = (b, self._blocks[b].reuses)
        return hits

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
        block.hash = block.token_bytes = block.parent = None
        block.reuses += 1
        block.ref_count = 1
        return b

    def _register(self, table: list[int], i: int, data: bytes, block_hash: int) -> None:
        """Index ``table[i]``, full with the tokens of ``data`` whose K/V are written, under ``block_hash``."""
        block = self._blocks[table[i]]
        block.hash = block_hash
        block.token_bytes = data
        block.parent = (table[i - 1], self._blocks[table[i - 1]].reuses) if i else None
        self._hash_to_block.setdefault(block.hash, block.block_id)

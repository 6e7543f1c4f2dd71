"""Block manager: a stateful random test (hypothesis) over allocate / append_token / forward (completed
or failed) / commit / free, with ``check_invariants`` after every step. It also simulates the K/V pool:
each written slot holds the token prefix its K/V depends on, so any wrong sharing, overwrite of a
shared block, or hit on a block whose forward failed shows as a mismatched slot."""


from array import array

from helpers import check_invariants, snapshot
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedflash.cache import block_manager as bm_module
from pagedflash.cache.block_manager import BlockManager, NoFreeBlocksError, chain_hash_bytes

# ----------------------------------------------------------------------------- stateful random test

TOKENS = st.integers(0, 2)  # a tiny vocabulary so prefixes repeat
WEAK_HASH_BUCKETS = 3  # with the weak hash nearly every block collides: hits must be confirmed by content


def weak_chain_hash(parent_hash, data):
    return hash((parent_hash, data)) % WEAK_HASH_BUCKETS


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append_token / forward (completed or failed) / commit / free over a small
    pool, with a simulated K/V pool: a completed forward writes each slot with the token prefix its
    K/V depends on, a failed one leaves garbage in some of the slots it was writing."""

    @initialize(
        num_blocks=st.integers(8, 32),
        page_size=st.integers(1, 4),
        caching=st.booleans(),
        weak_hash=st.booleans(),
    )
    def setup(self, num_blocks, page_size, caching, weak_hash):
        if weak_hash:
            bm_module.chain_hash_bytes = weak_chain_hash  # restored in teardown
        self.bm = BlockManager(num_blocks, page_size, enable_prefix_caching=caching)
        self.pool: dict[int, tuple] = {}  # slot -> token prefix its K/V was computed from
        self.computed: dict[int, int] = {}  # live seq -> leading tokens written by completed forwards
        self.registered: dict[int, tuple[int, tuple]] = {}  # block -> (reuses, prefix) when committed
        self.next_id = 0

    def _slot(self, seq_id, i):
        p = self.bm.page_size
        return self.bm._seqs[seq_id].block_table[i // p] * p + i % p

    def _lru_check(self, before_evictable, before_uncached, *, hits, num_fresh):
        """New blocks come from the uncached ones first, then evict the least recently used."""
        candidates = [b for b in before_evictable if b not in hits]
        num_evicted = max(0, num_fresh - before_uncached)
        assert [b for b in candidates if b not in self.bm._evictable] == candidates[:num_evicted]

    def _commit(self, seq_id, num_tokens):
        self.bm.commit(seq_id, num_tokens)
        seq, p = self.bm._seqs[seq_id], self.bm.page_size
        assert seq.num_committed == (max(seq.num_committed, num_tokens // p) if self.bm.enable_prefix_caching else 0)
        for i in range(seq.num_committed):
            b = seq.block_table[i]
            self.registered[b] = (self.bm._blocks[b].reuses, tuple(seq.token_ids[: (i + 1) * p]))

    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=12))
    def allocate(self, tokens):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        before, evictable, uncached = snapshot(self.bm), list(self.bm._evictable), len(self.bm._free_uncached)
        try:
            table, cached = self.bm.allocate(seq_id, tokens)
        except NoFreeBlocksError:
            assert snapshot(self.bm) == before
            assert not self.bm.can_allocate(len(tokens))
            return
        p = self.bm.page_size
        assert cached % p == 0 and cached < len(tokens)
        assert self.bm.num_committed_tokens(seq_id) == cached
        self._lru_check(evictable, uncached, hits=table[: cached // p], num_fresh=len(table) - cached // p)
        self.computed[seq_id] = cached  # the hits' K/V are in the pool (checked by the invariant)

    @precondition(lambda self: self.bm._seqs)
    @rule(data=st.data(), token=TOKENS)
    def append_token(self, data, token):
        seq_id = data.draw(st.sampled_from(sorted(self.bm._seqs)))
        before, evictable, uncached = snapshot(self.bm), list(self.bm._evictable), len(self.bm._free_uncached)
        can, num_blocks = self.bm.can_append(seq_id), len(self.bm.block_table(seq_id))
        try:
            table = self.bm.append_token(seq_id, token)
        except NoFreeBlocksError:
            assert not can and snapshot(self.bm) == before
            return
        assert can
        self._lru_check(evictable, uncached, hits=[], num_fresh=len(table) - num_blocks)

    @precondition(lambda self: self.bm._seqs)
    @rule(data=st.data())
    def reserve_block(self, data):
        """A block for the next token before the token: a step launched ahead writes that token's
        slot with K/V of a token the manager does not hold yet (garbage to it). The next append_token
        fills the block without a new one; release_reserved gives it back if the step is dropped."""
        seq_id = data.draw(st.sampled_from(sorted(self.bm._seqs)))
        before, num_blocks = snapshot(self.bm), len(self.bm.block_table(seq_id))
        needed = self.bm.num_tokens(seq_id) == num_blocks * self.bm.page_size
        try:
            table = self.bm.reserve_block(seq_id)
        except NoFreeBlocksError:
            assert needed and self.bm.num_free_blocks == 0 and snapshot(self.bm) == before
            return
        assert len(table) == num_blocks + needed and self.bm.can_append(seq_id)
        self.pool[self._slot(seq_id, self.bm.num_tokens(seq_id))] = ("ahead",)

    @precondition(lambda self: self.bm._seqs)
    @rule(data=st.data())
    def release_reserved(self, data):
        """The step launched ahead was dropped: back to the blocks the tokens fill."""
        seq_id = data.draw(st.sampled_from(sorted(self.bm._seqs)))
        table, free = self.bm.block_table(seq_id), self.bm.num_free_blocks
        kept = -(-self.bm.num_tokens(seq_id) // self.bm.page_size)
        assert self.bm.release_reserved(seq_id) == table[:kept]
        assert self.bm.num_free_blocks == free + len(table) - kept

    @precondition(lambda self: any(self.computed[s] < self.bm.num_tokens(s) for s in self.bm._seqs))
    @rule(data=st.data(), fails=st.booleans(), commit=st.booleans())
    def forward(self, data, fails, commit):
        """One forward over the next chunk of a sequence: completes (then maybe commits), or fails
        after writing some of the chunk's slots (a layer raised: K/V half written)."""
        seq_id = data.draw(st.sampled_from(sorted(s for s in self.bm._seqs if self.computed[s] < self.bm.num_tokens(s))))
        tokens, start = self.bm._seqs[seq_id].token_ids, self.computed[seq_id]
        end = data.draw(st.integers(start + 1, len(tokens)), label="end")
        before = snapshot(self.bm)
        if fails:
            for i in range(start, data.draw(st.integers(start, end), label="written before the failure")):
                self.pool[self._slot(seq_id, i)] = ("garbage",)
            assert snapshot(self.bm) == before
            return
        for i in range(start, end):
            self.pool[self._slot(seq_id, i)] = tuple(tokens[: i + 1])
        self.computed[seq_id] = end
        if commit:
            self._commit(seq_id, end)

    @precondition(lambda self: self.bm._seqs)
    @rule(data=st.data())
    def commit_lagging(self, data):
        """A commit of tokens computed earlier (any amount up to what was computed)."""
        seq_id = data.draw(st.sampled_from(sorted(self.bm._seqs)))
        self._commit(seq_id, data.draw(st.integers(0, self.computed[seq_id]), label="num_tokens"))

    @precondition(lambda self: self.bm._seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.bm._seqs)))
        self.bm.free(seq_id)
        del self.computed[seq_id]

    def teardown(self):
        bm_module.chain_hash_bytes = chain_hash_bytes

    @invariant()
    def invariants_hold(self):
        check_invariants(self.bm)

    @invariant()
    def computed_tokens_read_their_own_kv(self):
        """Every position a sequence counts as computed (its prefix hits included) holds its own K/V."""
        for seq_id, seq in self.bm._seqs.items():
            for i in range(self.computed[seq_id]):
                assert self.pool[self._slot(seq_id, i)] == tuple(seq.token_ids[: i + 1])

    @invariant()
    def every_cached_block_holds_its_kv(self):
        """A block with a hash (held or free) holds the K/V of the prefix it was committed with."""
        p = self.bm.page_size
        for block in self.bm._blocks:
            if block.hash is None:
                continue
            reuses, prefix = self.registered[block.block_id]
            assert reuses == block.reuses and array("q", prefix[-p:]).tobytes() == block.token_bytes
            for j in range(p):
                assert self.pool[block.block_id * p + j] == prefix[: len(prefix) - p + j + 1]


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase

"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step packs, under a budget of ``max_num_batched_tokens`` tokens and ``max_num_seqs`` rows:

1. one decode token for every running sequence that has exactly one token without K/V (oldest first);
   a decode that needs a new page when the pool is empty preempts the newest running sequence
   (its pages are freed, it goes back to the front of the queue and is recomputed later);
2. the next prefill chunk of running sequences admitted in an earlier step;
3. new (or preempted) sequences from the queue, first come first served, while their pages fit
   (not in a step that had to preempt, unless nothing is running).

Pages come from :class:`pagedflash.cache.BlockManager`, which registers full blocks for prefix
sharing as soon as they are allocated. The scheduler tracks which pages really hold their K/V
(``_written``): a prefix hit on a page whose K/V no step has produced yet (its writer is still
prefilling, or was preempted) is not trusted; the reader computes from that page on instead
(writing the same values a second time, which is harmless). K/V written in a step is visible to
every row of that step, because each layer writes the cache before it attends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedflash.cache import BlockManager, NoFreeBlocksError
from pagedflash.engine.sequence import Sequence, Status


@dataclass
class ScheduledRow:
    seq: Sequence
    start: int  # first position fed this step (== seq.num_computed)
    num_tokens: int  # tokens fed this step
    decode: bool = False  # the one token sampled last step (not a prompt or recompute chunk)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this row reaches the end of the sequence, so its last logits give a new token."""
        return self.end == len(self.seq)


@dataclass
class Batch:
    rows: list[ScheduledRow]

    @property
    def is_decode_only(self) -> bool:
        return all(r.num_tokens == 1 for r in self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.page_size = block_manager.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._written: set[int] = set()  # pages whose K/V is in the pool
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preemptions = self.num_preemptions
        # 1. decodes, oldest first; may preempt the newest running sequences
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or len(seq) - seq.num_computed != 1:
                continue
            appended = self.bm.num_tokens(seq.seq_id) < len(seq)
            if appended and not self._make_room_for_token(seq):
                continue  # seq itself was the newest and got preempted
            rows.append(self._take(seq, 1, decode=appended))
            budget -= 1
        # 2. chunks of prefills already running
        scheduled = {id(r.seq) for r in rows}
        for seq in self.running:
            if budget == 0:
                break
            if id(seq) not in scheduled and seq.num_computed < len(seq) == self.bm.num_tokens(seq.seq_id):
                n = min(len(seq) - seq.num_computed, budget)
                rows.append(self._take(seq, n))
                budget -= n
        # 3. admissions (none in a step that had to preempt: the pool is too full to take more)
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and (self.num_preemptions == preemptions or not self.running)):
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            n = min(len(seq) - seq.num_computed, budget)
            rows.append(self._take(seq, n))
            budget -= n
        if not rows and self.has_unfinished():
            raise RuntimeError("scheduler made no progress (a request larger than the page pool slipped through)")
        return Batch(rows)

    def postprocess(self, batch: Batch, tokens: list[int], now: float, eos_ids: set[int], max_len: int) -> list[Sequence]:
        """Advance every row; append sampled tokens; return the sequences that finished."""
        finished = []
        it = iter(tokens)
        for row in batch.rows:
            seq = row.seq
            seq.num_computed = row.end
            if not row.samples:
                continue
            token = next(it)
            seq.token_ids.append(token)
            seq.token_times.append(now)
            p = seq.params
            if (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.num_generated >= p.max_tokens or len(seq) >= max_len:
                seq.finish_reason = "length"
            if seq.finish_reason:
                self._finish(seq)
                finished.append(seq)
        return finished

    def schedule_ahead(self, batch: Batch) -> Batch | None:
        """The step after ``batch``, to launch before ``batch``'s tokens are known, or None.

        Only when ``batch`` decodes every running sequence greedily, nothing waits (no admission
        would change the rows), and each row's next position lies in a page the sequence holds (no
        allocation, so no preemption). The rows are the same sequences one position further; the
        input tokens are ``batch``'s, on the device. Rows whose sequence turns out to have finished
        are dropped by :meth:`confirm_ahead`; what they computed is discarded (their K/V went to a
        slot of their own partly filled page, never a cached one)."""
        if self.waiting or len(batch.rows) != len(self.running):
            return None
        p = self.page_size
        rows = []
        for row, seq in zip(batch.rows, self.running):
            if row.seq is not seq or row.num_tokens != 1 or not row.samples or not seq.params.greedy:
                return None
            pos = len(seq)  # where batch's token goes
            if pos % p == 0:  # a new page: allocation (maybe preemption) needs the sync path
                return None
            rows.append(ScheduledRow(seq, pos, 1, decode=True))
        for r in rows:
            self.mark_written(r.seq.block_table, r.end, r.start)
        return Batch(rows)

    def confirm_ahead(self, ahead: Batch) -> list[int]:
        """After :meth:`postprocess` of the step before ``ahead``: hand the block manager each
        continuing row's new token (it completes no allocation: the page is held) and drop the rows
        whose sequence finished. Returns the indices of the kept rows in ``ahead``'s results."""
        keep = []
        for i, row in enumerate(ahead.rows):
            seq = row.seq
            if seq.status is Status.RUNNING:
                seq.block_table = self.bm.append_token(seq.seq_id, seq.token_ids[-1])
                keep.append(i)
        ahead.rows = [ahead.rows[i] for i in keep]
        return keep

    # ------------------------------------------------------------------ internals
    def mark_written(self, block_table: list[int], end: int, start: int = 0) -> None:
        """Positions ``start .. end - 1`` get their K/V this step: the pages they complete are written."""
        p = self.page_size
        self._written.update(block_table[start // p : end // p])

    def _take(self, seq: Sequence, n: int, decode: bool = False) -> ScheduledRow:
        """Schedule positions ``num_computed .. +n`` of ``seq``."""
        row = ScheduledRow(seq, seq.num_computed, n, decode)
        self.mark_written(seq.block_table, row.end, row.start)
        return row

    def _admit(self, seq: Sequence) -> bool:
        try:
            table, num_cached = self.bm.allocate(seq.seq_id, seq.token_ids)
        except NoFreeBlocksError:
            return False
        p = self.page_size
        num_hits = num_cached // p
        for b in table[num_hits:]:
            self._written.discard(b)  # fresh pages: whatever they held is gone
        ready = 0
        while ready < num_hits and table[ready] in self._written:
            ready += 1
        seq.block_table = table
        seq.num_computed = ready * p
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _make_room_for_token(self, seq: Sequence) -> bool:
        """Give the block manager ``seq``'s newest token, preempting the newest sequences for a page.
        False when ``seq`` itself had to be preempted."""
        while not self.bm.can_append(seq.seq_id):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        old = len(seq.block_table)
        seq.block_table = self.bm.append_token(seq.seq_id, seq.token_ids[-1])
        for b in seq.block_table[old:]:
            self._written.discard(b)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.block_table = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def abort_all(self) -> None:
        """Drop every request (their pages go back to the pool); used when a step fails. The pages of
        that step may never have been written, so no cached page is trusted any more."""
        for seq in list(self.running):
            self._finish(seq)
        self.waiting.clear()
        self._written.clear()

    def _finish(self, seq: Sequence) -> None:
        self.bm.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = Status.FINISHED
        seq.block_table = []

"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step packs, under a budget of ``max_num_batched_tokens`` tokens and ``max_num_seqs`` rows:

1. one decode token for every running sequence that has exactly one token without K/V (oldest first);
   a decode that needs a new page when the pool is empty preempts the newest running sequence
   (its pages are freed, it goes back to the front of the queue and is recomputed later);
2. the next prefill chunk of running sequences admitted in an earlier step;
3. new (or preempted) sequences from the queue, first come first served, while their pages fit
   (not in a step that had to preempt, unless nothing is running), and while the next one's prompt
   does not share a page that a prefill chunk of this step completes: admitted a step later, it
   hits that page instead of computing it a second time.

A request asking for ``prompt_logprobs`` is admitted at the first prompt position whose entry is
missing even where its pages are prefix-cache hits (:mod:`pagedflash.engine.logprobs`).

Pages come from :class:`pagedflash.cache.BlockManager`. A sequence's tokens count as computed,
and their full pages join the prefix cache (``BlockManager.commit``), only in :meth:`postprocess`,
after the forward that wrote their K/V has completed. A step that fails before that changes no
sequence's progress and registers no page: its rows keep the pages they were given and are
scheduled again, and a page it half wrote is never hit by another request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedflash.cache import BlockManager, NoFreeBlocksError
from pagedflash.engine.logprobs import StepLogprobs
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
            if self._completes_shared_page(rows, seq) or not self._admit(seq):
                break
            self.waiting.popleft()
            n = min(len(seq) - seq.num_computed, budget)
            rows.append(self._take(seq, n))
            budget -= n
        if not rows and self.has_unfinished():
            raise RuntimeError("scheduler made no progress (a request larger than the page pool slipped through)")
        return Batch(rows)

    def postprocess(self, batch: Batch, tokens: list[int], now: float, eos_ids: set[int], max_len: int,
                    logprobs: StepLogprobs | None = None) -> list[Sequence]:
        """After ``batch``'s forward completed: advance every row, commit the pages it filled, append
        the sampled ``tokens`` (one per sampling row, in order) and the step's ``logprobs``; return the
        sequences that got a token (those that finished with it are FINISHED). Rows whose request was
        aborted meanwhile are skipped."""
        sampled = []
        it = iter(tokens)
        for i, row in enumerate(batch.rows):
            seq = row.seq
            token = next(it) if row.samples else None
            if seq.status is not Status.RUNNING:
                continue
            seq.num_computed = row.end
            if row.end // self.page_size > row.start // self.page_size:  # only a full page joins the cache
                self.bm.commit(seq.seq_id, row.end)
            if logprobs is not None and i in logprobs.prompt:
                seq.prompt_logprobs += logprobs.prompt[i]
                if len(seq.prompt_logprobs) == seq.num_prompt_tokens and seq.logprobs is None:
                    seq.asks_logprobs = False  # its prompt entries are complete; it needs no more
            if token is None:
                continue
            seq.token_ids.append(token)
            if logprobs is not None and i in logprobs.sampled:
                seq.logprobs.append(logprobs.sampled[i])
            seq.token_times.append(now)
            p = seq.params
            # a grammar ends with its stop token accepted, or refusing one where no token continued it
            ended = seq.grammar is not None and (not seq.grammar.accept(token) or seq.grammar.terminated)
            if ended or (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.num_generated >= p.max_tokens or len(seq) >= max_len:
                seq.finish_reason = "length"
            if seq.finish_reason:
                self._finish(seq)
            sampled.append(seq)
        return sampled

    # ------------------------------------------------------------------ internals
    def _completes_shared_page(self, rows: list[ScheduledRow], seq: Sequence) -> bool:
        """Whether a prefill row of this step completes a page that ``seq``'s prompt could hit (the
        page and every page before it equal to ``seq``'s)."""
        p, tokens = self.page_size, seq.token_ids
        limit = (len(tokens) - 1) // p  # pages a prompt can hit: at least one token is computed
        for row in rows:
            first, last = row.start // p, min(row.end // p, limit)  # pages [first, last) complete now
            if row.decode or first >= last:
                continue
            other = row.seq.token_ids
            end = (first + 1) * p
            if other[first * p : end] == tokens[first * p : end] and other[:end] == tokens[:end]:
                return True
        return False

    def _take(self, seq: Sequence, n: int, decode: bool = False) -> ScheduledRow:
        """Schedule positions ``num_computed .. +n`` of ``seq``."""
        return ScheduledRow(seq, seq.num_computed, n, decode)

    def _admit(self, seq: Sequence) -> bool:
        try:
            table, num_cached = self.bm.allocate(seq.seq_id, seq.token_ids)
        except NoFreeBlocksError:
            return False
        seq.block_table = table
        seq.num_computed = seq.num_prefix_hit = num_cached
        entries = seq.prompt_logprobs
        if entries is not None and len(entries) < seq.num_prompt_tokens:
            # cached prompt tokens have no logits: compute again from the first position whose entry
            # is missing (in their shared pages without writing: pagedflash.engine.logprobs)
            seq.num_computed = min(num_cached, len(entries) - 1)
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
        seq.block_table = self.bm.append_token(seq.seq_id, seq.token_ids[-1])
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

    def abort(self, seq: Sequence) -> None:
        """End an unfinished request now (``finish_reason="abort"``); a running one frees its pages."""
        if seq.status is Status.RUNNING:
            self._finish(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
            seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or "abort"

    def _finish(self, seq: Sequence) -> None:
        self.bm.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = Status.FINISHED
        seq.block_table = []

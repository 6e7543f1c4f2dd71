"""Run-ahead decode: the host launches a greedy decode step before it reads the tokens of the step
before it, so its per-step work overlaps the device's instead of adding to it (see
docs/performance.md, "v12 — run-ahead decode").

A decode step whose rows all sample greedily leaves its tokens on the device and copies them to the
host behind itself (:class:`pagedflash.engine.runner.PendingTokens`). Its successor is known without
those tokens when every running sequence is in it, nothing waits for admission (no admission could
change the rows), and each row's next position lies in a page the sequence holds or one the pool can
give it now (``BlockManager.reserve_block``: no preemption): the same rows one position further,
whose input ids the runner copies on the device (:meth:`ModelRunner.launch_ahead
<pagedflash.engine.runner.ModelRunner.launch_ahead>`). Rows cross page boundaries at different steps
once their lengths differ (32 rows over 16-row pages: two a step on average), so a rule that stopped
at every boundary would run nearly every step synchronously. At most one step is in flight ahead;
a step dropped before its tokens were read gives its reserved blocks back. A row that its in-flight
token finishes (a stop id, ``max_tokens``) may still get a block, freed with it a step later; a row
at ``max_model_len`` stops the rule (its successor's position does not exist). A row whose request
finished (or was aborted) by the time its step is read is dropped, and a step that lost rows is not
followed ahead: the runner's buffers are laid out by row, so the next step goes through the
scheduler, which lays them out again. What a dropped row
computed went to a slot of its own partly filled page, never a cached one. A step with rows asking
for logprobs samples synchronously (the runner does not defer its tokens), so it is not followed
ahead, and the rows of a deferred step (hence of one launched after it) ask for none.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedflash.engine.logprobs import StepLogprobs
from pagedflash.engine.runner import ModelRunner, PendingTokens
from pagedflash.engine.scheduler import Batch, ScheduledRow, Scheduler
from pagedflash.engine.sequence import Status


@dataclass
class LaunchedStep:
    """A step whose forward is launched: its rows, and its sampled tokens on their way."""

    batch: Batch  # the rows still counted (rows of finished or aborted requests are dropped)
    pending: PendingTokens  # one token per sampling row as launched
    kept: list[int] | None = None  # indices into the launched rows of those in ``batch``; None: all
    reserved: tuple = ()  # seq ids given a block ahead of the token this step writes

    def tokens(self) -> list[int]:
        """The sampled tokens of the rows in ``batch``, in order (waits for the device)."""
        tokens = self.pending.result()
        return tokens if self.kept is None else [tokens[i] for i in self.kept]

    @property
    def logprobs(self) -> StepLogprobs | None:
        """The step's logprobs by row of ``batch`` (None when no row asked). A step with them was
        never deferred, so it was neither launched ahead nor followed ahead and ``kept`` is None."""
        return self.pending.logprobs

    def keep_running(self) -> None:
        """Drop the rows whose request is no longer running."""
        keep = [i for i, row in enumerate(self.batch.rows) if row.seq.status is Status.RUNNING]
        if len(keep) < len(self.batch.rows):
            self.kept = [keep_i if self.kept is None else self.kept[keep_i] for keep_i in keep]
            self.batch = Batch([self.batch.rows[i] for i in keep])


class RunAhead:
    """Launches the engine's steps: a scheduled one, or the greedy decode step it launched ahead.

    ``enabled=False`` launches every step from the scheduler (the synchronous loop); the tokens are
    the same either way.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, *, enabled: bool = True):
        self.scheduler = scheduler
        self.runner = runner
        self.enabled = enabled
        self._ahead: LaunchedStep | None = None

    def next_step(self) -> LaunchedStep:
        """The step to finish now: the one in flight ahead (without rows whose request ended
        since), or a newly scheduled and launched one."""
        step, self._ahead = self._ahead, None
        if step is not None:
            step.keep_running()
            if step.batch.rows:
                return step
        batch = self.scheduler.schedule()
        return LaunchedStep(batch, self.runner.launch(batch))

    def launch_successor(self, step: LaunchedStep) -> None:
        """Before ``step``'s tokens are read: launch the step after it, when that one is known
        without them."""
        if not (self.enabled and step.pending.deferred and step.kept is None):
            return
        batch = self._successor(step.batch)
        if batch is None:
            return
        bm, p = self.scheduler.bm, self.scheduler.page_size
        new_page = [row.seq for row in batch.rows if row.start % p == 0]
        reserved = tuple(seq.seq_id for seq in new_page)
        try:
            for seq in new_page:
                seq.block_table = bm.reserve_block(seq.seq_id)
            self._ahead = LaunchedStep(batch, self.runner.launch_ahead(batch), reserved=reserved)
        except BaseException:
            self._release(reserved)
            raise

    def confirm(self) -> None:
        """After the scheduler took the tokens of the step before the one in flight: hand the block
        manager each continuing row's new token (its page is held: no allocation) and drop the rows
        whose request finished with it."""
        ahead = self._ahead
        if ahead is None:
            return
        ahead.keep_running()
        if not ahead.batch.rows:
            self._ahead = None
            return
        bm = self.scheduler.bm
        for row in ahead.batch.rows:
            row.seq.block_table = bm.append_token(row.seq.seq_id, row.seq.token_ids[-1])

    def discard(self) -> None:
        """Forget the step in flight (a step failed, or requests are being dropped): nothing of it is
        counted, its rows are scheduled again, and its K/V writes landed in slots that those rows
        rewrite (their sequences' own partly filled pages, or blocks reserved for it, which go back to
        the pool). The runner's record of its tables must be dropped with it
        (``ModelRunner.forget_decode_tables``)."""
        if self._ahead is not None:
            self._release(self._ahead.reserved)
        self._ahead = None

    def _release(self, seq_ids: tuple) -> None:
        """Give back the blocks reserved for ``seq_ids`` that no token reached."""
        bm = self.scheduler.bm
        for seq in self.scheduler.running:
            if seq.seq_id in seq_ids and seq.seq_id in bm:
                seq.block_table = bm.release_reserved(seq.seq_id)

    def _successor(self, batch: Batch) -> Batch | None:
        """``batch``'s rows one position further, or None when that step needs the scheduler."""
        sched = self.scheduler
        if sched.waiting or len(batch.rows) != len(sched.running):
            return None
        p = sched.page_size
        rows, new_pages = [], 0
        for row, seq in zip(batch.rows, sched.running):
            if row.seq is not seq or row.num_tokens != 1 or not row.samples or not seq.params.raw_greedy:
                return None
            pos = len(seq)  # where batch's token goes
            if pos >= self.runner.max_model_len:  # the row ends with that token; no position (or page) for it
                return None
            new_pages += pos % p == 0  # a new page: reserved now if the pool has it free
            rows.append(ScheduledRow(seq, pos, 1, decode=True))
        if new_pages > sched.bm.num_free_blocks:  # the scheduler decides whom to preempt
            return None
        return Batch(rows)

"""Run-ahead decode: the host launches a greedy decode step before it reads the tokens of the step
before it, so its per-step work overlaps the device's instead of adding to it (see
docs/performance.md, "v12 — run-ahead decode").

A decode step whose rows all sample greedily leaves its tokens on the device and copies them to the
host behind itself (:class:`pagedflash.engine.runner.PendingTokens`). Its successor is known without
those tokens when every running sequence is in it, nothing waits for admission (no admission could
change the rows), and each row's next position lies in a page the sequence holds (no allocation, so
no preemption): the same rows one position further, whose input ids the runner copies on the device
(:meth:`ModelRunner.launch_ahead <pagedflash.engine.runner.ModelRunner.launch_ahead>`). At most one
step is in flight ahead. A row whose request finished (or was aborted) by the time its step is read
is dropped, and a step that lost rows is not followed ahead: the runner's buffers are laid out by
row, so the next step goes through the scheduler, which lays them out again. What a dropped row
computed went to a slot of its own partly filled page, never a cached one.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedflash.engine.runner import ModelRunner, PendingTokens
from pagedflash.engine.scheduler import Batch, ScheduledRow, Scheduler
from pagedflash.engine.sequence import Status


@dataclass
class LaunchedStep:
    """A step whose forward is launched: its rows, and its sampled tokens on their way."""

    batch: Batch  # the rows still counted (rows of finished or aborted requests are dropped)
    pending: PendingTokens  # one token per sampling row as launched
    kept: list[int] | None = None  # indices into the launched rows of those in ``batch``; None: all

    def tokens(self) -> list[int]:
        """The sampled tokens of the rows in ``batch``, in order (waits for the device)."""
        tokens = self.pending.result()
        return tokens if self.kept is None else [tokens[i] for i in self.kept]

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
        if batch is not None:
            self._ahead = LaunchedStep(batch, self.runner.launch_ahead(batch))

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
        rewrite (their sequences' own partly filled pages)."""
        self._ahead = None

    def _successor(self, batch: Batch) -> Batch | None:
        """``batch``'s rows one position further, or None when that step needs the scheduler."""
        sched = self.scheduler
        if sched.waiting or len(batch.rows) != len(sched.running):
            return None
        p = sched.page_size
        rows = []
        for row, seq in zip(batch.rows, sched.running):
            if row.seq is not seq or row.num_tokens != 1 or not row.samples or not seq.params.greedy:
                return None
            pos = len(seq)  # where batch's token goes
            if pos % p == 0:  # a new page: allocation (maybe preemption) needs the scheduler
                return None
            rows.append(ScheduledRow(seq, pos, 1, decode=True))
        return Batch(rows)

"""The engine loop: one thread owns the :class:`~pagedflash.engine.LLM` and runs its steps.

The engine is not thread-safe, so only this thread calls it. HTTP handlers (on the asyncio event
loop) talk to it through two lists under one condition variable: requests to add and requests to
abort. The thread runs ``step()`` while the engine has work and waits on the condition when it has
none (no busy loop). After each step it hands every request's new tokens to that request's
``asyncio.Queue`` with one ``call_soon_threadsafe`` per step: the queues are unbounded, so a slow
client never holds up a step; its tokens wait in its queue.

Events put on a queue (each a tuple):

- ``("tokens", tag, new_token_ids, finish_reason, num_cached_tokens, new_logprobs, prompt_logprobs)``:
  ``finish_reason`` is None while the request runs, else ``"stop"`` or ``"length"``;
  ``new_logprobs`` the step's ``RequestOutput.new_logprobs`` (None unless asked for);
  ``prompt_logprobs`` its ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``, in the
  request's first event; else None);
- ``("error", tag, message)``: the step running the request raised; the request is aborted;
- ``("timeline", tag, stamps)``: only with ``timeline=True``, once, just before the request's first
  ``tokens`` event: the engine side's stamps of :mod:`.timeline` (``submit`` through
  ``first_token``, ``steps_waiting``, ``steps_to_first_token``).

A submission with ``structured_outputs`` first has its grammars compiled on a thread of the loop's
(:meth:`~pagedflash.engine.LLM.compile_grammar`, outside the GIL), while this thread goes on
stepping the requests already running; it is then admitted like any other, its grammars found in
the compiler's cache (a grammar the compiler refuses is refused by ``add_request`` as before).

A step that raises fails the requests it was running (their pages go back to the pool through
``abort_request``); the loop goes on with the others and with new ones. Admission errors
(``add_request`` raising ``TypeError``/``ValueError``) come back to the submitter as
:class:`RequestRejected`; more waiting requests than ``max_queue`` as :class:`QueueFullError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from pagedflash.engine.sampling import SamplingParams
from pagedflash.engine.workers import WorkerError

# Submissions whose grammars compile at once (xgrammar compiles outside the GIL): a grammar that takes
# seconds holds one of them, not every structured request behind it; 2 to 4, a quarter of the host's
# cores, so that compiles leave the engine loop's thread a core.
GRAMMAR_THREADS = min(4, max(2, (os.cpu_count() or 1) // 4))

logger = logging.getLogger("pagedflash.serve")


class QueueFullError(RuntimeError):
    """More requests would wait for admission than the server's ``max_queue``."""


class EngineClosedError(RuntimeError):
    """The server is shutting down and takes no new request."""


class RequestRejected(ValueError):
    """``add_request`` refused prompt ``index`` of a submission, or (``index`` None) the submission is
    refused as a whole; the message says why."""

    def __init__(self, index: int | None, error: Exception):
        super().__init__(str(error))
        self.index = index
        self.error = error


@dataclass
class _Submission:
    """Prompts of one HTTP request, admitted together or not at all."""

    prompts: list[list[int]]
    params: SamplingParams | list[SamplingParams]  # one for all, or one per prompt
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    arrival: float = field(default_factory=time.perf_counter)
    stamps: dict | None = None  # with a timeline: the stamps taken before the loop picked it
    compiled: bool = False  # its grammars compiled (or none to compile)
    closed: bool = False  # told the server shut down while its grammars compiled

    def unique_params(self) -> list:
        """Its params, each object once."""
        return list({id(p): p for p in (self.params if isinstance(self.params, list) else [self.params])}.values())


@dataclass
class _Live:
    """A request in the engine: where its events go and its timings."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    tag: int
    arrival: float
    last_token: float | None = None
    stamps: dict | None = None  # with a timeline, until the first token: its stamps so far


def _deliver(events: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)


def check_admission(accepting: bool, waiting: int, num_prompts: int, max_queue: int | None) -> None:
    """Raise :class:`EngineClosedError` or :class:`QueueFullError` if ``num_prompts`` more may not wait
    for admission behind ``waiting``."""
    if not accepting:
        raise EngineClosedError("the server is shutting down")
    if max_queue is not None and num_prompts > max_queue:  # a retry can never fit: the client's error
        raise RequestRejected(None, ValueError(f"a request of {num_prompts} sequences (prompts times n) is more "
                                            f"than the {max_queue} requests the server queues (--max-queue)"))
    if max_queue is not None and waiting + num_prompts > max_queue:
        raise QueueFullError(f"{waiting} requests are waiting for admission and the server queues at most "
                             f"{max_queue} (--max-queue); retry later")


def resolve(future: asyncio.Future, ids: list[int] | None, error: Exception | None, abort) -> None:
    """On the event loop: an admission's outcome; a submitter that left meanwhile gets its ids aborted."""
    if future.cancelled():
        if ids:
            abort(ids)
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(ids)


class EngineLoop:
    """Runs ``llm``'s steps in a thread of its own.

    llm: an :class:`~pagedflash.engine.LLM`, used by this thread only once :meth:`start` ran.
    metrics: an :class:`~pagedflash.entrypoints.openai.metrics.EngineMetrics` to record, or None.
    max_queue: requests that may wait for admission (queued in the engine or not yet handed to it);
    None: no limit. timeline: stamp each request's way to its first token (the ``timeline`` event).
    """

    def __init__(self, llm, *, metrics=None, max_queue: int | None = None, timeline: bool = False):
        if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0):
            raise ValueError(f"max_queue must be an int >= 0 or None, got {max_queue!r}")
        self.llm = llm
        self.metrics = metrics
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._pending: list[_Submission] = []
        self._compiling: list[_Submission] = []  # handed to the grammar threads (under _cond)
        self._grammar_pool: concurrent.futures.ThreadPoolExecutor | None = None  # made on the first grammar
        self._aborts: list[tuple[int, str]] = []
        self._accepting = True
        self.engine_failure: str | None = None  # why the engine closed itself (a WorkerError); None: it did not
        self._stopping = False
        self._num_waiting = 0  # the engine's waiting queue after the loop's last visit (under _cond)
        self._num_unfinished = 0  # requests in the engine after the loop's last visit (under _cond)
        self._live: dict[int, _Live] = {}  # loop thread only
        self._thread: threading.Thread | None = None
        self._prefix = (0, 0)  # prefix-cache (queried, hit) tokens already counted
        self._preemptions = 0
        self.timeline = timeline
        self._steps = 0  # step calls that returned
        self._unscheduled: dict[int, dict] = {}  # with a timeline: stamps of requests no step has run yet

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        stats = self.llm.block_manager.stats
        self._prefix = (stats.queried_tokens, stats.hit_tokens)
        self._preemptions = self.llm.scheduler.num_preemptions
        self._thread = threading.Thread(target=self._run, name="pagedflash-engine-loop", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """Refuse new submissions (:class:`EngineClosedError`); requests in flight go on."""
        with self._cond:
            self._accepting = False

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is left (its queues get an ``error`` event) and end the thread."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def abort(self, request_ids, reason: str = "abort") -> None:
        """Abort requests (counted as finished for ``reason``: ``"abort"``, or ``"stop"`` when the
        server matched a stop string); already finished ones are ignored. Does not wait."""
        with self._cond:
            self._aborts.extend((rid, reason) for rid in request_ids)
            self._cond.notify()

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not finished, as of the loop's last visit plus those not yet handed over."""
        with self._cond:
            return self._num_unfinished + sum(len(s.prompts) for s in (*self._pending, *self._compiling))

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.engine_failure is None

    # ------------------------------------------------------------------ event loop
    async def submit(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                     queue: asyncio.Queue) -> list[int]:
        """Hand ``prompts`` (token ids) to the engine with ``params`` (one for all, or one per prompt);
        their events go to ``queue``, tagged with the prompt's index. Returns the request ids (for
        :meth:`abort`) once the loop admitted them all.

        Raises :class:`QueueFullError`, :class:`EngineClosedError`, or :class:`RequestRejected` (then no
        prompt of the submission runs). Cancelled while waiting, the prompts are aborted."""
        loop = asyncio.get_running_loop()
        sub = _Submission(prompts, params, queue, loop, loop.create_future())
        self._enqueue(sub)
        return await sub.future

    def _enqueue(self, sub: _Submission) -> None:
        """Queue ``sub`` for the loop (any thread); the admission's outcome goes to ``sub.future``
        through ``sub.loop.call_soon_threadsafe``."""
        with self._cond:
            if self.engine_failure is not None:
                raise EngineClosedError(f"the engine failed: {self.engine_failure}")
            waiting = self._num_waiting + sum(len(s.prompts) for s in (*self._pending, *self._compiling))
            check_admission(self._accepting, waiting, len(sub.prompts), self.max_queue)
            self._pending.append(sub)
            self._cond.notify()

    def _resolve(self, future: asyncio.Future, ids: list[int] | None, error: Exception | None) -> None:
        resolve(future, ids, error, self.abort)

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        llm = self.llm
        while True:
            busy = self._has_work()
            with self._cond:
                while not (busy or self._pending or self._aborts or self._stopping):
                    self._cond.wait()
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
            if self.timeline and pending:
                picked = time.perf_counter()
                for sub in pending:
                    sub.stamps = {"submit": sub.arrival, "picked": picked, **(sub.stamps or {})}  # the first pick
            try:
                self._apply_aborts(aborts)
                if stopping:
                    self._fail(list(self._live), "the server shut down before the request finished", "abort")
                    with self._cond:  # and those whose grammars compiled since the pick, or still compile
                        late, self._pending, compiling, self._compiling = self._pending, [], self._compiling, []
                        for sub in compiling:
                            sub.closed = True
                    for sub in (*pending, *late, *compiling):
                        self._call(sub.loop, self._resolve, sub.future, None, EngineClosedError("the server shut down"))
                    self._publish()
                    return
                pending = self._compile_first(pending)
                outcomes = [self._admit(sub) for sub in pending]  # never raises
                try:
                    if pending:  # first: a submitter told "admitted" must find itself counted
                        self._publish(counts_only=True)
                finally:
                    for sub, ids, error in outcomes:
                        self._call(sub.loop, self._resolve, sub.future, ids, error)
                if llm.has_unfinished_requests():
                    self._step()
            except Exception:  # a bug here must not end the loop: log it, fail what is in flight
                logger.exception("engine loop error")
                self._fail(list(self._live), "internal error in the engine loop", "error")
            try:
                self._publish()
            except Exception:
                logger.exception("engine loop: publishing the counts failed")

    def _needs_compile(self, sub: _Submission) -> bool:
        """Some prompt's params have ``structured_outputs`` the engine did not compile lately."""
        return not sub.compiled and self.engine_failure is None and any(
            getattr(p, "structured_outputs", None) is not None and not self.llm.grammar_compiled(p)
            for p in sub.unique_params())

    def _compile_first(self, pending: list[_Submission]) -> list[_Submission]:
        """Hand the submissions with grammars to compile to the grammar threads; the others (and any the
        thread cannot take: then compiled by ``add_request``, on this thread), to admit now."""
        now = []
        for sub in pending:
            if not self._needs_compile(sub):
                now.append(sub)
                continue
            with self._cond:
                self._compiling.append(sub)
            try:
                if self._grammar_pool is None:
                    self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
                        GRAMMAR_THREADS, thread_name_prefix="pagedflash-grammar")
                self._grammar_pool.submit(self._compile_grammars, sub)
            except RuntimeError:  # no thread (shut down by a stop that timed out, or none to start)
                with self._cond:
                    self._compiling.remove(sub)
                now.append(sub)
        return now

    def _compile_grammars(self, sub: _Submission) -> None:
        """On a grammar thread: compile ``sub``'s grammars, then queue it for admission (whose
        ``add_request`` reports a grammar the compiler refused)."""
        try:
            for one in sub.unique_params():
                self.llm.compile_grammar(one)
        except Exception:  # add_request raises it again, on the loop thread, as for any bad request
            pass
        finally:
            with self._cond:
                if not sub.closed:
                    self._compiling.remove(sub)
                    sub.compiled = True
                    if sub.stamps is not None:
                        sub.stamps["compiled"] = time.perf_counter()
                    self._pending.append(sub)
                    self._cond.notify()

    def _has_work(self) -> bool:
        try:
            return self.llm.has_unfinished_requests()
        except Exception:
            return False

    def _call(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop closed (shutdown): nobody is listening
            pass

    def _admit(self, sub: _Submission) -> tuple[_Submission, list[int] | None, Exception | None]:
        """Add the submission's prompts (all or none); what to tell the submitter."""
        if self.engine_failure is not None:  # queued before the engine failed
            return sub, None, EngineClosedError(f"the engine failed: {self.engine_failure}")
        ids = []
        params = sub.params if isinstance(sub.params, list) else [sub.params] * len(sub.prompts)
        try:
            for prompt, one in zip(sub.prompts, params):
                ids.append(self.llm.add_request(prompt, one))
        except Exception as e:
            try:
                for rid in ids:
                    self.llm.abort_request(rid)
            except Exception:
                logger.exception("abort_request failed after a failed admission")
            if isinstance(e, (TypeError, ValueError)):
                return sub, None, RequestRejected(len(ids), e)
            logger.exception("add_request failed")
            return sub, None, RuntimeError(f"the engine could not take the request: {type(e).__name__}: {e}")
        added = time.perf_counter() if sub.stamps is not None else None
        for i, (rid, prompt) in enumerate(zip(ids, sub.prompts)):
            live = self._live[rid] = _Live(sub.queue, sub.loop, i, sub.arrival)
            if added is not None:
                live.stamps = self._unscheduled[rid] = {**sub.stamps, "added": added, "added_step": self._steps}
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(prompt))
        return sub, ids, None

    def _apply_aborts(self, aborts: list[tuple[int, str]]) -> None:
        now = time.perf_counter()
        for rid, reason in aborts:
            live = self._live.pop(rid, None)
            if live is not None:
                self.llm.abort_request(rid)
                if self.metrics is not None:
                    self.metrics.finished[reason].inc()
                    if reason == "stop":  # a stop string ended it: a finished request, timed like the others
                        self.metrics.e2e.observe(now - live.arrival)

    def _fail(self, request_ids: list[int], message: str, reason: str) -> None:
        """Abort these requests and send each an ``error`` event."""
        events: dict[asyncio.AbstractEventLoop, list] = {}
        for rid in request_ids:
            live = self._live.pop(rid, None)
            try:
                self.llm.abort_request(rid)
            except Exception:
                logger.exception("abort_request(%d) failed", rid)
            if live is None:
                continue
            events.setdefault(live.loop, []).append((live.queue, ("error", live.tag, message)))
            if self.metrics is not None:
                self.metrics.finished[reason].inc()
        for loop, batch in events.items():
            self._call(loop, _deliver, batch)

    def _step(self) -> None:
        llm = self.llm
        began = time.perf_counter() if self._unscheduled else None
        try:
            outputs = llm.step()
        except Exception as e:
            logger.exception("step failed; failing the requests it was running")
            if isinstance(e, WorkerError):  # the engine closed itself (a tensor-parallel rank died): no more
                with self._cond:           # requests (503), /health unhealthy, the rest fail below
                    self._accepting = False
                    self.engine_failure = f"{type(e).__name__}: {e}"
            running = [] if self.engine_failure is not None else [seq.seq_id for seq in llm.scheduler.running
                                                      if seq.seq_id in self._live]
            self._fail(running or list(self._live), f"the engine step failed: {type(e).__name__}: {e}", "error")
            return
        now = time.perf_counter()
        self._steps += 1
        if began is not None:
            self._stamp_scheduled(outputs, began)
        metrics = self.metrics
        events: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            n = len(out.new_token_ids)
            if live.stamps is not None and n:
                stamps = self._first_token(live, now)
                events.setdefault(live.loop, []).append((live.queue, ("timeline", live.tag, stamps)))
            if metrics is not None and n:
                metrics.generation_tokens.inc(n)
                first = live.last_token is None
                if first:
                    metrics.ttft.observe(now - live.arrival)
                gap = 0.0 if first else (now - live.last_token) / n  # tokens of one step share its time
                for _ in range(n - 1 if first else n):
                    metrics.itl.observe(gap)
            if out.new_token_ids:
                live.last_token = now
            if out.finished:
                del self._live[out.request_id]
                if metrics is not None:
                    metrics.finished[out.finish_reason].inc()
                    metrics.e2e.observe(now - live.arrival)
            events.setdefault(live.loop, []).append(
                (live.queue, ("tokens", live.tag, out.new_token_ids, out.finish_reason if out.finished else None,
                              out.num_cached_tokens, out.new_logprobs, out.prompt_logprobs)))
        for loop, batch in events.items():
            self._call(loop, _deliver, batch)

    def _stamp_scheduled(self, outputs, began: float) -> None:
        """Stamp ``scheduled`` (``began``: when the step call began) on the requests the step ran first."""
        ran = {seq.seq_id for seq in self.llm.scheduler.running}
        ran.update(out.request_id for out in outputs)
        for rid in [rid for rid in self._unscheduled if rid in ran or rid not in self._live]:
            stamps = self._unscheduled.pop(rid)
            stamps["scheduled"] = began
            stamps["steps_waiting"] = self._steps - 1 - stamps.pop("added_step")
            stamps["scheduled_step"] = self._steps

    def _first_token(self, live: _Live, now: float) -> dict:
        """The request's engine-side stamps, complete with its first token (now); stamping ends."""
        stamps, live.stamps = live.stamps, None
        stamps["first_token"] = now
        scheduled_step = stamps.pop("scheduled_step", None)
        stamps["steps_to_first_token"] = None if scheduled_step is None else self._steps - scheduled_step + 1
        return stamps

    def _publish(self, counts_only: bool = False) -> None:
        """Counts for admission control, and (unless ``counts_only``) the metrics' gauges and counters."""
        llm = self.llm
        scheduler, bm = llm.scheduler, llm.block_manager
        with self._cond:
            self._num_waiting = len(scheduler.waiting)
            self._num_unfinished = len(self._live)
        m = self.metrics
        if m is None or counts_only:
            return
        m.running.set(len(scheduler.running))
        m.waiting.set(len(scheduler.waiting))
        m.kv_usage.set(1.0 - bm.num_free_blocks / llm.num_blocks)
        queried, hit = bm.stats.queried_tokens, bm.stats.hit_tokens
        m.prefix_queries.inc(queried - self._prefix[0])
        m.prefix_hits.inc(hit - self._prefix[1])
        self._prefix = (queried, hit)
        m.preemptions.inc(scheduler.num_preemptions - self._preemptions)
        self._preemptions = scheduler.num_preemptions

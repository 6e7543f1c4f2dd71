"""The engine loop in a child process (``pagedflash serve --engine-process``).

:class:`EngineProcess` has :class:`~.engine_loop.EngineLoop`'s interface (``submit``, ``abort``,
``start``, ``stop_accepting``, ``stop``, ``num_unfinished``, ``accepting``, ``alive``, ``metrics``),
so the handlers do not know which one they talk to. The child (``multiprocessing``'s spawn context:
CUDA is initialized there only) builds the :class:`~pagedflash.engine.LLM` with
:func:`~.api_server.build_llm` from the server's options and runs an :class:`~.engine_loop.EngineLoop`
whose events, admission outcomes and metric updates, instead of going to asyncio queues and to
Prometheus, are collected and sent up the pipe as one message per loop iteration (one step). The
HTTP process keeps tokenizing, detokenizing, formatting and the metrics' exposition, so its Python
work does not take the GIL from the engine's host work.

Messages (plain pickled tuples) down the pipe: ``("submit", sub_id, prompts, params, arrival)``
(``params``: one SamplingParams for all the prompts, or a list of one each),
``("abort", request_ids, reason)``, ``("stop",)``. Up the pipe: ``("ready", limits)`` or
``("failed", type name, message)`` once, then per iteration ``("step", num_waiting, num_unfinished,
items, metric_ops, engine_failure)`` where ``items`` are ``("event", sub_id, event)`` (an :mod:`.engine_loop`
event; a ``timeline`` event gets the reader's ``reader`` stamp here) and ``("admitted", sub_id,
ids, error)``, in the order the loop made them (the counts are None in a refusal the child sends
outside the loop), and ``engine_failure`` is None, or why the engine closed itself (a
:class:`~pagedflash.engine.WorkerError`: the child lives on, its engine serves no more).

One reader thread in the HTTP process receives the messages; per message it replays the metric
updates on the server's :class:`~.metrics.EngineMetrics` and hands the events to the event loop with
one ``call_soon_threadsafe``. Admission control (``--max-queue``, shutting down) is decided in the
HTTP process, from the child's last counts plus the submissions not yet admitted. A request's
arrival is stamped there with ``time.perf_counter`` (the system-wide monotonic clock, so the child's
TTFT and end-to-end latencies count from the HTTP request as in a thread). A child that dies
makes :attr:`EngineProcess.alive` false (``/health`` answers 503), fails the requests in flight with
an ``error`` event (a 500) and later submissions with :class:`~.engine_loop.EngineClosedError` (a 503);
so does an engine that failed in a live child (its loop fails the requests in flight). The
child ignores SIGINT and SIGTERM (the server drains, then sends ``stop``) and exits when the pipe
closes, so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
import time
from dataclasses import dataclass, field

from pagedflash.engine.sampling import SamplingParams
from pagedflash.entrypoints.openai.engine_loop import (
    EngineClosedError,
    EngineLoop,
    QueueFullError,
    RequestRejected,
    _Submission,
    check_admission,
    resolve,
)
from pagedflash.entrypoints.openai.metrics import FINISHED_REASONS

logger = logging.getLogger("pagedflash.serve")
_ERRORS = {cls.__name__: cls for cls in (EngineClosedError, QueueFullError, RuntimeError, ValueError, TypeError,
                                         FileNotFoundError)}


# ------------------------------------------------------------------ the child
class _MetricOp:
    """Records ``set``/``inc``/``observe`` calls on one metric as ``(key, method, value)``."""

    def __init__(self, ops: list, key):
        self.ops, self.key = ops, key

    def set(self, value):
        self.ops.append((self.key, "set", value))

    def inc(self, value=1):
        self.ops.append((self.key, "inc", value))

    def observe(self, value):
        self.ops.append((self.key, "observe", value))


class _MetricsRecorder:
    """Stands for :class:`~.metrics.EngineMetrics` in the child: every update is recorded in ``ops``."""

    def __init__(self):
        self.ops: list = []
        self.finished = {r: _MetricOp(self.ops, ("finished", r)) for r in FINISHED_REASONS}

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        op = _MetricOp(self.ops, name)
        setattr(self, name, op)
        return op


def replay(metrics, ops) -> None:
    """Apply recorded ``ops`` to ``metrics`` (an :class:`~.metrics.EngineMetrics`)."""
    for key, method, value in ops:
        metric = metrics.finished[key[1]] if isinstance(key, tuple) else getattr(metrics, key)
        getattr(metric, method)(value)


class _Immediate:
    """The child's stand-in for a submission's event loop: the loop thread's calls run at once."""

    @staticmethod
    def call_soon_threadsafe(fn, *args):
        fn(*args)


_IMMEDIATE = _Immediate()


@dataclass
class _Outbox:
    """Where the child's queue and future stand-ins put what goes up the pipe (loop thread only)."""

    items: list = field(default_factory=list)


class _PipeQueue:
    def __init__(self, outbox: _Outbox, sub_id: int):
        self.outbox, self.sub_id = outbox, sub_id

    def put_nowait(self, event):
        self.outbox.items.append(("event", self.sub_id, event))


class _PipeFuture:
    """An admission's outcome, sent to the HTTP process (which handles a submitter that left)."""

    def __init__(self, outbox: _Outbox, sub_id: int):
        self.outbox, self.sub_id = outbox, sub_id

    def cancelled(self) -> bool:
        return False

    def set_result(self, ids):
        self.outbox.items.append(("admitted", self.sub_id, ids, None))

    def set_exception(self, error):
        self.outbox.items.append(("admitted", self.sub_id, None, _wire_error(error)))


def _wire_error(error: Exception) -> tuple:
    """An admission error as plain data (an exception class of the engine may not pickle)."""
    if isinstance(error, RequestRejected):
        return ("RequestRejected", error.index, type(error.error).__name__, str(error))
    return (type(error).__name__, str(error))


def _unwire_error(wire: tuple) -> Exception:
    if wire[0] == "RequestRejected":
        _, index, kind, message = wire
        return RequestRejected(index, (TypeError if kind == "TypeError" else ValueError)(message))
    kind, message = wire
    return _ERRORS.get(kind, RuntimeError)(message)


class _ChildLoop(EngineLoop):
    """An :class:`EngineLoop` whose iteration ends by sending its events and metric updates up ``conn``."""

    def __init__(self, llm, conn, send_lock: threading.Lock, *, timeline: bool = False):
        super().__init__(llm, metrics=_MetricsRecorder(), timeline=timeline)
        self.conn, self.send_lock = conn, send_lock
        self.outbox = _Outbox()

    def _publish(self, counts_only: bool = False) -> None:
        try:
            super()._publish(counts_only)
        finally:
            if not counts_only:
                self._flush()

    def _flush(self) -> None:
        items, self.outbox.items = self.outbox.items, []
        ops = self.metrics.ops[:]
        del self.metrics.ops[:]  # in place: the recorder's metrics append to this list
        with self._cond:
            counts = (self._num_waiting, self._num_unfinished)
        try:
            with self.send_lock:
                self.conn.send(("step", *counts, items, ops, self.engine_failure))
        except (OSError, EOFError, BrokenPipeError):  # the server is gone: nobody is listening
            pass


def _child_main(args, conn) -> None:
    """The engine process: build the engine, report ready, run the loop until ``stop`` or the pipe closes."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    from pagedflash.entrypoints.openai.api_server import build_llm, engine_limits

    try:
        llm = build_llm(args)
    except BaseException as e:
        conn.send(("failed", type(e).__name__, str(e)))
        conn.close()
        return
    conn.send(("ready", engine_limits(llm)))
    send_lock = threading.Lock()
    engine = _ChildLoop(llm, conn, send_lock, timeline=getattr(args, "request_timeline", None) is not None)
    engine.start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "submit":
                _, sub_id, prompts, params, arrival = msg
                future = _PipeFuture(engine.outbox, sub_id)
                sub = _Submission(prompts, params, _PipeQueue(engine.outbox, sub_id), _IMMEDIATE, future, arrival,
                                  {"received": time.perf_counter()} if engine.timeline else None)
                try:
                    engine._enqueue(sub)
                except EngineClosedError as e:  # stopping: told at once, from this thread
                    with send_lock:
                        conn.send(("step", None, None, [("admitted", sub_id, None, _wire_error(e))], [], None))
            elif msg[0] == "abort":
                engine.abort(msg[1], msg[2])
            elif msg[0] == "stop":
                break
    finally:
        engine.stop(timeout=None)
        conn.close()


# ------------------------------------------------------------------ the HTTP process
@dataclass
class _Sub:
    """A submission as the HTTP process tracks it."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    num_prompts: int
    ids: list[int] | None = None
    open: set[int] = field(default_factory=set)  # indices of prompts admitted and not finished


class EngineProcess:
    """The engine loop in a child process, with :class:`~.engine_loop.EngineLoop`'s interface.

    Building one starts the child and waits until its engine is built (raising the child's
    ``FileNotFoundError``/``ValueError``/``TypeError`` as such, anything else as ``RuntimeError``);
    :attr:`limits` is the model's ``max_model_len``, ``vocab_size`` and ``pool_tokens``.
    args: the server's parsed options (:func:`~.api_server.parse_args`). metrics: an
    :class:`~.metrics.EngineMetrics` to record. max_queue: as :class:`~.engine_loop.EngineLoop`'s.
    """

    def __init__(self, args, *, metrics, max_queue: int | None = None):
        if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0):
            raise ValueError(f"max_queue must be an int >= 0 or None, got {max_queue!r}")
        self.metrics = metrics
        self.max_queue = max_queue
        self._lock = threading.Lock()  # the fields below, shared by the event loop and the reader thread
        self._subs: dict[int, _Sub] = {}
        self._by_id: dict[int, tuple[int, int]] = {}  # request id -> (sub id, prompt index)
        self._next_sub = 0
        self._unadmitted = 0  # prompts submitted and not yet admitted or refused
        self._num_waiting = 0
        self._num_unfinished = 0
        self._accepting = True
        self._stopping = False
        self._dead = False
        self._engine_failure: str | None = None  # the child's engine closed itself: why
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        # not a daemon: its engine may start tensor-parallel workers; it exits when the pipe closes
        self.process = ctx.Process(target=_child_main, args=(args, child_conn), name="pagedflash-engine")
        self.process.start()
        child_conn.close()
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(10)
            raise RuntimeError(f"the engine process exited while starting (exit code {self.process.exitcode})") \
                from None
        if msg[0] == "failed":
            self.process.join(30)
            self._conn.close()
            raise _unwire_error(msg[1:])
        self.limits: dict = msg[1]

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._reader = threading.Thread(target=self._read, name="pagedflash-engine-reader", daemon=True)
        self._reader.start()

    def stop_accepting(self) -> None:
        """Refuse new submissions (:class:`EngineClosedError`); requests in flight go on."""
        with self._lock:
            self._accepting = False

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is left (its queues get an ``error`` event) and end the child and the reader."""
        with self._lock:
            self._accepting = False
            self._stopping = True
        self._send(("stop",))
        deadline = None if timeout is None else time.monotonic() + timeout
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop in %s s; terminating it", timeout)
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        if self._reader is not None:
            self._reader.join(None if deadline is None else max(1.0, deadline - time.monotonic()))
        self._conn.close()

    def abort(self, request_ids, reason: str = "abort") -> None:
        """Abort requests (counted as finished for ``reason``); already finished ones are ignored. Does not wait."""
        request_ids = list(request_ids)
        with self._lock:
            for rid in request_ids:
                self._close(rid)
        self._send(("abort", request_ids, reason))

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return self._num_unfinished + self._unadmitted

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._dead and self._engine_failure is None

    @property
    def alive(self) -> bool:
        return (self._reader is not None and self._reader.is_alive() and not self._dead
                and self._engine_failure is None and self.process.is_alive())

    # ------------------------------------------------------------------ event loop
    async def submit(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                     queue: asyncio.Queue) -> list[int]:
        """As :meth:`.EngineLoop.submit`."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._dead:
                raise EngineClosedError("the engine process is gone")
            if self._engine_failure is not None:
                raise EngineClosedError(f"the engine failed: {self._engine_failure}")
            check_admission(self._accepting, self._num_waiting + self._unadmitted, len(prompts), self.max_queue)
            sub_id = self._next_sub
            self._next_sub += 1
            self._subs[sub_id] = _Sub(queue, loop, future, len(prompts))
            self._unadmitted += len(prompts)
        if not self._send(("submit", sub_id, prompts, params, time.perf_counter())):
            self._fail_all("the engine process is gone")
        return await future

    # ------------------------------------------------------------------ internals
    def _send(self, msg) -> bool:
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, EOFError, BrokenPipeError, ValueError):  # ValueError: the pipe was closed here
            return False

    def _close(self, rid: int) -> None:
        """Forget request ``rid`` (under ``_lock``); its submission goes when none of its prompts is open."""
        where = self._by_id.pop(rid, None)
        if where is None:
            return
        sub = self._subs.get(where[0])
        if sub is not None:
            sub.open.discard(where[1])
            if not sub.open and sub.ids is not None:
                del self._subs[where[0]]

    def _read(self) -> None:
        """The reader thread: a message per child iteration, dispatched with one call per event loop."""
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._dispatch(msg)
            except Exception:
                logger.exception("engine process: dispatching a message failed")
        self._fail_all("the server shut down before the request finished" if self._stopping
                       else "the engine process died")

    def _dispatch(self, msg) -> None:
        _, num_waiting, num_unfinished, items, ops, engine_failure = msg
        received = None
        calls: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            if engine_failure is not None:  # before the handlers see the requests' errors
                self._engine_failure = engine_failure
            if num_waiting is not None:  # None: a refusal sent before the loop counted anything
                self._num_waiting, self._num_unfinished = num_waiting, num_unfinished
            for item in items:
                sub = self._subs.get(item[1])
                if item[0] == "admitted":
                    _, sub_id, ids, error = item
                    if sub is None:
                        continue
                    self._unadmitted -= sub.num_prompts
                    if error is None:
                        sub.ids, sub.open = ids, set(range(len(ids)))
                        self._by_id.update((rid, (sub_id, i)) for i, rid in enumerate(ids))
                    else:
                        del self._subs[sub_id]
                    calls.setdefault(sub.loop, []).append(
                        (resolve, sub.future, ids, None if error is None else _unwire_error(error), self.abort))
                elif sub is not None:  # an event
                    event = item[2]
                    calls.setdefault(sub.loop, []).append((sub.queue.put_nowait, event))
                    kind = event[0]
                    if kind == "timeline":
                        received = received or time.perf_counter()
                        event[2]["reader"] = received
                    elif kind == "error" or event[3] is not None:
                        self._close(sub.ids[event[1]])
        replay(self.metrics, ops)  # before the handlers see the events
        for loop, batch in calls.items():
            _call(loop, _run_all, batch)

    def _fail_all(self, message: str) -> None:
        """The child is gone: every submission still here fails (admission or events); no more submissions."""
        calls: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            self._dead = True
            subs, self._subs, self._by_id = self._subs, {}, {}
            self._unadmitted = self._num_waiting = self._num_unfinished = 0
        for sub in subs.values():
            batch = calls.setdefault(sub.loop, [])
            if sub.ids is None:
                batch.append((resolve, sub.future, None, RuntimeError(message), self.abort))
                continue
            for i in sorted(sub.open):
                batch.append((sub.queue.put_nowait, ("error", i, message)))
                self.metrics.finished["error"].inc()
        for loop, batch in calls.items():
            _call(loop, _run_all, batch)


def _run_all(calls) -> None:
    for fn, *args in calls:
        fn(*args)


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop closed (shutdown): nobody is listening
        pass

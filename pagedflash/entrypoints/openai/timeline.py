"""Per-request timelines (``pagedflash serve --request-timeline PATH``): where a request's time goes
between the HTTP handler and the first token on the wire.

Off by default; when off no stamp is taken (the engine loop and the handlers test one attribute).
On, every engine request (each of the ``n`` choices of each prompt of a batched completion) that
ends, finished or not, appends one JSON line to ``PATH`` (the file is opened for appending, each
line flushed). Timestamps are ``time.perf_counter()`` seconds: CLOCK_MONOTONIC on Linux, one clock
for the HTTP process and the engine process, so they compare across ``--engine-process``. The
stamps, in the order a request passes them (a phase that a mode or an outcome does not pass is
absent):

========== ===================================================================================
http       the handler began (headers read; the body not yet parsed)
submit     validated and tokenized: handed to the engine loop (``submit``)
received   ``--engine-process`` only: the engine process read the submission from the pipe
picked     the engine loop took it, between two steps
compiled   ``structured_outputs`` whose grammar the engine did not compile lately only: the loop's
           grammar threads (one of them) compiled it (the loop takes it again at its next visit)
added      ``LLM.add_request`` returned
scheduled  the ``LLM.step`` call that first ran the request began (its first prefill chunk)
first_token  the ``LLM.step`` call that returned the request's first token returned
reader     ``--engine-process`` only: the HTTP process's reader thread got that step's message
handler    the first token reached the request's handler on the event loop
sent       streamed: the chunk holding the first token was written to the connection (the
           stream asked for the next one); not streamed: the handler took the first token
finished   the handler was done with the HTTP request (its every choice)
========== ===================================================================================

Other fields: ``request`` (one id per HTTP request), ``index`` (the choice's, ``prompt_index * n
+ j``), ``request_id`` (the engine's), ``mode`` (``"process"`` or ``"thread"``), ``stream``,
``prompt_tokens``, ``cached_tokens``, ``output_tokens``, ``finish_reason`` (None: the request failed
or was aborted), ``steps_waiting`` (engine steps between ``added`` and ``scheduled``),
``steps_to_first_token`` (steps from ``scheduled`` through ``first_token``, both counted) and
``unix_time`` (of ``http``). ``pagedflash.bench.timeline`` summarizes a file.
"""

from __future__ import annotations

import itertools
import json
import threading
import time

PHASES = ("http", "submit", "received", "picked", "compiled", "added", "scheduled", "first_token", "reader", "handler",
          "sent", "finished")


class RequestTimeline:
    """Appends one JSON line per ended request to ``path`` (from any thread)."""

    def __init__(self, path: str, mode: str):
        if mode not in ("process", "thread"):
            raise ValueError(f"mode must be 'process' or 'thread', got {mode!r}")
        self.path, self.mode = path, mode
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def begin(self) -> dict:
        """The stamps of a new HTTP request: its ``http`` time, and the ids its lines share."""
        return {"http": time.perf_counter(), "unix_time": time.time(), "request": next(self._ids)}

    def write(self, records: list[dict]) -> None:
        lines = "".join(json.dumps({"mode": self.mode, **r}) + "\n" for r in records)
        with self._lock:
            if not self._file.closed:
                self._file.write(lines)

    def close(self) -> None:
        with self._lock:
            self._file.close()

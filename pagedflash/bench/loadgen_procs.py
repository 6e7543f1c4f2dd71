"""One sweep point of ``bench online`` sent by one client process or split over several
(:class:`ClientPool`), so that the client's CPU does not limit what is measured.

With ``P`` processes (``min(processes, requests, max_concurrency)``), request ``i`` goes to process
``i % P`` with its send time from the parent's one draw of arrival offsets; a concurrency cap ``C``
becomes shares of ``ceil(C / P)`` or ``floor(C / P)`` summing to ``C`` (each process caps its own
share). Each process (spawn context: its own interpreter, asyncio loop and httpx client) reports
ready, then every process starts at one ``time.monotonic()`` start time sent by the parent, and
sends back its :class:`~pagedflash.bench.loadgen.RequestResult` list, duration and CPU seconds. The
parent merges the results in request order: the metrics are computed as for one process. The
point's duration is the longest process's (all count from the shared start); its client CPU % is
the busiest process's CPU seconds over that duration.

Bounded: a process that dies, or does not report ready within ``start_timeout`` seconds or its
results within its arrival span plus ``ceil(share / cap)`` request timeouts (plus a minute), has its
requests failed with an error that says so; a new one starts at the next point.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import wait

from pagedflash.bench import loadgen

START_MARGIN_S = 0.05  # from the parent's send of the start time to the start itself


def _worker(conn) -> None:
    """A client process: for each job ``(requests, run_load keywords)``, says ``("ready",)``,
    receives the start time, runs, and sends ``("done", results, duration, cpu_s)`` (or
    ``("error", text)``). ``None`` ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it ends the pool
    while (job := conn.recv()) is not None:
        requests, kw = job

        def start_at() -> float:
            conn.send(("ready",))
            return conn.recv()

        cpu = time.process_time()
        try:
            results, duration = asyncio.run(loadgen.run_load(requests, start_at=start_at, **kw))
        except Exception as e:  # noqa: BLE001  (reported to the parent, which fails this share)
            conn.send(("error", f"{type(e).__name__}: {e}"[:300]))
            continue
        conn.send(("done", results, duration, time.process_time() - cpu))


class ClientPool:
    """``processes`` client processes, started once and reused by every point (a spawned
    interpreter takes seconds to import); a context manager that ends them."""

    def __init__(self, processes: int, *, start_timeout: float = 120.0):
        loadgen._check_count("client_processes", processes)
        self.ctx = mp.get_context("spawn")
        self.start_timeout = start_timeout
        self.procs: list = [None] * processes
        self.conns: list = [None] * processes
        for w in range(processes):
            self._spawn(w)

    def _spawn(self, w: int) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child,), daemon=True, name=f"bench-online-client-{w}")
        proc.start()
        child.close()
        self.procs[w], self.conns[w] = proc, parent

    def _end(self, w: int) -> None:
        proc = self.procs[w]
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        self.conns[w].close()

    def close(self) -> None:
        """Asks every process to end, then kills those still running after 5 s."""
        for proc, conn in zip(self.procs, self.conns):
            if proc.is_alive() and not conn.closed:
                try:
                    conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + 5.0
        for w, proc in enumerate(self.procs):
            proc.join(max(0.0, deadline - time.monotonic()))
            self._end(w)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _collect(self, workers: Sequence[int], deadlines: dict[int, float], kind: str,
                 since: float) -> dict[int, tuple]:
        """Each worker's next message (``kind`` or an error), by its deadline; a worker that dies or
        misses it is ended (:meth:`run` starts a new one) and gets ``("error", why)``."""
        got, waiting = {}, set(workers)
        while waiting:
            by = {self.conns[w]: w for w in waiting} | {self.procs[w].sentinel: w for w in waiting}
            ready = wait(list(by), max(0.0, min(deadlines[w] for w in waiting) - time.monotonic()))
            for obj in ready:
                w = by[obj]
                if w not in waiting:
                    continue
                msg = None
                if obj is self.conns[w] or self.conns[w].poll():
                    try:
                        msg = self.conns[w].recv()
                    except (EOFError, OSError):
                        msg = None
                if msg is None:
                    self.procs[w].join(1)
                    msg = ("error", f"client process {w} exited (code {self.procs[w].exitcode}) with its "
                                    f"requests in flight")
                    self._end(w)
                got[w] = msg
                waiting.discard(w)
            for w in [w for w in waiting if time.monotonic() >= deadlines[w]]:
                got[w] = ("error", f"client process {w} sent no {kind} within "
                                   f"{deadlines[w] - since:.0f} s; it was killed")
                waiting.discard(w)
                self._end(w)
        return got

    def _send(self, w: int, obj) -> None:
        try:
            self.conns[w].send(obj)
        except OSError:  # it died: _collect sees its sentinel and fails its share
            pass

    def run(self, requests: Sequence[loadgen.Request], offsets: Sequence[float], *, max_concurrency: int | None = None,
            timeout: float = 600.0, **kw) -> tuple[list[loadgen.RequestResult], float, float]:
        """``requests`` sent at ``offsets`` over the pool: (results in request order, duration,
        the busiest process's CPU seconds)."""
        n = len(requests)
        p = min(len(self.procs), n, max_concurrency or n)
        shares = [list(range(w, n, p)) for w in range(p)]
        caps = [max_concurrency // p + (w < max_concurrency % p) for w in range(p)] if max_concurrency else [None] * p
        for w in range(p):
            if not self.procs[w].is_alive():
                self._spawn(w)
        asked = time.monotonic()
        for w, idx in enumerate(shares):
            job = dict(kw, timeout=timeout, max_concurrency=caps[w], offsets=[offsets[i] for i in idx])
            self._send(w, ([requests[i] for i in idx], job))
        msgs = self._collect(range(p), dict.fromkeys(range(p), asked + self.start_timeout), "ready", asked)
        started = [w for w in range(p) if msgs[w][0] == "ready"]
        start = time.monotonic() + START_MARGIN_S
        for w in started:
            self._send(w, start)
        deadlines = {w: start + max(offsets[i] for i in shares[w]) + 60.0
                     + math.ceil(len(shares[w]) / (caps[w] or len(shares[w]))) * timeout for w in started}
        msgs |= self._collect(started, deadlines, "results", start)
        results: list = [None] * n
        duration, cpu = 0.0, 0.0
        for w, idx in enumerate(shares):
            msg = msgs[w]
            if msg[0] == "done":
                _, got, took, cpu_s = msg
                duration, cpu = max(duration, took), max(cpu, cpu_s)
            else:
                got = [loadgen.RequestResult(error=msg[1], prompt_tokens=requests[i].prompt_len,
                                             expected_tokens=requests[i].max_tokens) for i in idx]
            for i, r in zip(idx, got):
                results[i] = r
        return results, duration or time.monotonic() - start, cpu


def run_point(requests: Sequence[loadgen.Request], *, pool: ClientPool | None = None, rate: float = math.inf,
              seed: int = 0, **kw) -> tuple[list[loadgen.RequestResult], float, float]:
    """One point: ``requests`` at Poisson ``rate`` (``seed``), in this process or over ``pool``;
    ``kw`` are :func:`~pagedflash.bench.loadgen.run_load`'s. Returns (results in request order,
    duration in seconds, client CPU % over the duration: the busiest process's)."""
    offsets = loadgen.arrival_offsets(len(requests), rate, seed)
    if pool is None:
        cpu = time.process_time()
        results, duration = asyncio.run(loadgen.run_load(requests, offsets=offsets, **kw))
        cpu = time.process_time() - cpu
    else:
        results, duration, cpu = pool.run(requests, offsets, **kw)
    return results, duration, 100 * cpu / duration if duration > 0 else 0.0

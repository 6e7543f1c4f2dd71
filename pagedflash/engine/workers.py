"""Tensor-parallel worker processes: how rank 0 starts, drives, watches and stops the other ranks.

``LLM(..., tensor_parallel_size=N)`` runs rank 0 in the user's process — the scheduler, the block
manager and sampling live there only — and starts ranks ``1 .. N-1`` as daemon processes with
``torch.multiprocessing`` (spawn). Every rank builds its shard (:mod:`pagedflash.engine.executor`)
and joins one process group: NCCL on GPUs, gloo on the CPU.

A step: rank 0's runner turns the scheduler's batch into the step's device input (token ids,
positions, cache slots, block-table entries: plain int lists), sends it to every worker as one
pickled message over a pipe (:meth:`Workers.run`), and runs the same runner method on it; each
worker runs that method on the same input, so the collectives pair up. Workers read nothing back:
the logits are gathered on every rank, so every rank computes the same greedy tokens, which feed
run-ahead decode on the device.

Failures never hang:

- before each step rank 0 checks that every worker lives; it waits on the device by polling, and
  checks again while it waits. A worker that raised sends its traceback before it exits; gloo
  raises at once when a peer's connection closes. On GPUs a watchdog thread ends the NCCL group the
  moment a worker exits (CUDA graphs released first, then an abort): a collective that lost its peer
  never ends on the device, and once the device stalls rank 0's host can block inside a CUDA call,
  where polling cannot reach it; the abort ends the stalled kernels. Either way ``step``/``generate`` raise
  :class:`WorkerError` naming the rank and why, and the engine is closed (its group cannot be
  trusted); later calls raise the same error.
- Ctrl-C while rank 0 runs a step's device work is held until that work is launched, so the ranks
  stay in step and the interrupted step is simply not counted, as with one GPU. A second Ctrl-C does
  not wait: it closes the engine.
- Workers are daemons, ignore SIGINT (rank 0 handles Ctrl-C), exit when their pipe closes (rank 0
  gone) and run a watchdog thread that exits when their parent disappears, even in the middle of a
  collective. ``LLM.close()``, ``with
  LLM(...)`` and a finalizer when the LLM is garbage-collected stop them and destroy the group.
- On two H200s, NCCL's destroy and abort appeared to wait for every CUDA graph that captured one of
  the group's collectives (``LLM.close()``, which drops its graphs first, never hung; the finalizer
  and the dead-worker path, with the graphs alive, did). The runner's graphs are therefore released
  first (:attr:`Workers.before_group_end`, registered before any capture). A graph whose replay is
  blocked in a host CUDA call is still referenced by that call and can still stall an abort; then
  :meth:`close` stops waiting for the watchdog after ``JOIN_S`` and leaves the group as it is.
  (This ordering has run on the CPU only so far, not yet on two GPUs.)
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import traceback
import warnings
from datetime import timedelta

import torch

from pagedflash import testing, validate
from pagedflash.engine.executor import EngineSpec, Rank, build_rank
from pagedflash.engine.parallel import make_collectives
from pagedflash.ops.utils import on_device

START_TIMEOUT_S = 300.0  # a worker must import torch and reach the group's rendezvous within this
GROUP_TIMEOUT_S = 900.0  # the process group's timeout for one collective (a backstop: dead peers are polled)
POLL_S = 0.01  # how often rank 0 checks the workers while it waits for the device
JOIN_S = 10.0  # how long close() waits for a worker to exit before terminating it
# NVLink multicast off in NCCL, symm_mem and NVSHMEM (unless the user set these): set before the group
# starts, inherited by the workers
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed, or the engine was closed after that."""


def _backend(spec: EngineSpec) -> str:
    return "nccl" if spec.device.type == "cuda" else "gloo"


class Workers:
    """Ranks ``1 .. N-1`` of a tensor-parallel engine, seen from rank 0. Starting them also makes
    rank 0 join the process group (``comm``); ``torch.distributed`` must not be initialized yet in
    this process (the engine owns its group and destroys it on :meth:`close`)."""

    def __init__(self, spec: EngineSpec):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1 starts its own torch.distributed process group, but this "
                               "process has one already (torchrun?); run the engine in a process without it")
        self.size = spec.tensor_parallel_size
        self.device = spec.device_of(0)
        self.procs: list = []
        self.conns: list = []
        self.closed: str | None = None  # why, once closed
        self._reported: dict[int, str] = {}  # each worker's last message: "joined", then "ready"
        # step messages: count, bytes, and rank 0's wall and CPU seconds pickling and writing them
        self.stats = {"messages": 0, "bytes": 0, "send_s": 0.0, "send_cpu_s": 0.0}
        self._owns_group = False
        self._group_lock = threading.Lock()  # the watchdog and close() both may end the group
        self._watchdog: tuple[threading.Thread, threading.Event] | None = None
        # run before the group ends (the owner's CUDA graphs' release: they hold NCCL references)
        self.before_group_end: list = []
        if spec.device.type == "cuda":
            for key, value in _NO_MULTICAST.items():
                os.environ.setdefault(key, value)
        store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=timedelta(seconds=START_TIMEOUT_S),
                              wait_for_workers=False)
        self._store = store  # the rendezvous lives in rank 0 and must outlive the group
        ctx = torch.multiprocessing.get_context("spawn")
        try:
            for rank in range(1, self.size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(rank, spec, store.port, theirs, os.getpid()),
                                   name=f"pagedflash-tp-rank{rank}", daemon=True)
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
            self._await("joined", START_TIMEOUT_S)
            kw = {"device_id": self.device} if spec.device.type == "cuda" else {}
            dist.init_process_group(_backend(spec), store=store, rank=0, world_size=self.size,
                                    timeout=timedelta(seconds=GROUP_TIMEOUT_S), **kw)
            self._owns_group = True
            if spec.device.type == "cuda":  # gloo raises by itself
                self._start_watchdog()
            self.comm = make_collectives(self.size, kind=spec.all_reduce, dtype=spec.dtype, device=self.device,
                                         invariant=spec.batch_invariant)
        except BaseException as e:
            self.fail(e)

    # ------------------------------------------------------------------ steps
    def run(self, runner, name: str, *args):
        """Send ``runner.name(*args)`` to every worker, then run it here; its result."""
        self.check()
        t0, cpu0 = time.perf_counter(), time.thread_time()
        message = pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL)
        with _held_interrupts():
            try:
                for conn in self.conns:
                    conn.send_bytes(message)
                stats = self.stats
                stats["messages"] += 1
                stats["bytes"] += len(message)
                stats["send_s"] += time.perf_counter() - t0
                stats["send_cpu_s"] += time.thread_time() - cpu0
                return getattr(runner, name)(*args)
            except BaseException as e:
                self.fail(e)

    def wait_event(self, event) -> None:
        """Wait for a CUDA ``event`` while checking that the workers live (a dead peer would leave
        this rank's collective, and so the event, waiting forever)."""
        next_check = time.perf_counter() + POLL_S
        while not event.query():
            if time.perf_counter() > next_check:
                self.check()
                next_check = time.perf_counter() + POLL_S

    def wait_device(self) -> None:
        """Wait for the work enqueued so far on this rank's GPU (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            with on_device(self.device):  # close() may run from a finalizer, under another current GPU
                event = torch.cuda.Event()
                event.record()
            self.wait_event(event)

    # ------------------------------------------------------------------ health
    def check(self) -> None:
        """Raise :class:`WorkerError` if the engine is closed or a worker failed (then close)."""
        if self.closed is not None:
            raise WorkerError(f"the tensor-parallel engine is closed: {self.closed}")
        problem = self._problem()
        if problem is not None:
            self.close(problem, failed=True)
            raise WorkerError(problem)

    def fail(self, error: BaseException):
        """Rank 0 raised ``error`` with the workers in the middle of a collective step (or of
        starting): close, and raise the workers' own error when one failed or died (a collective
        that lost its peer is how rank 0 learns it), else ``error``. Rank 0's own ``ValueError``,
        ``TypeError`` (bad weights, say: every rank meets them) and interrupts are raised as they are."""
        problem = None
        if not isinstance(error, (ValueError, TypeError, KeyboardInterrupt)):
            deadline = time.perf_counter() + 2.0  # a failing worker reports, then exits: give it a moment
            problem = self._problem()
            while problem is None and time.perf_counter() < deadline:
                time.sleep(0.05)
                problem = self._problem()
        self.close(problem or f"rank 0 raised {type(error).__name__}: {error}", failed=True)
        if problem is not None:
            raise WorkerError(problem) from error
        raise error

    def _problem(self) -> str | None:
        """Why a worker cannot go on (its traceback, or how it died), or None."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                while conn.poll():
                    kind, payload = conn.recv()
                    if kind == "error":
                        return f"tensor-parallel rank {rank} failed:\n{payload}"
                    self._reported[rank] = kind
            except (EOFError, OSError):
                pass  # its end is closed: it exited, which is_alive reports
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"
        return None

    def _await(self, kind: str, timeout: float) -> None:
        """Wait until every worker reported ``kind`` (checking them meanwhile)."""
        deadline = time.perf_counter() + timeout
        while any(self._reported.get(rank) != kind for rank in range(1, self.size)):
            problem = self._problem()
            if problem is not None:
                raise WorkerError(problem)
            if time.perf_counter() > deadline:
                late = [r for r in range(1, self.size) if self._reported.get(r) != kind]
                raise WorkerError(f"tensor-parallel ranks {late} did not report {kind!r} within {timeout:.0f} s")
            time.sleep(0.01)

    def build_rank0(self, spec: EngineSpec, generator: torch.Generator) -> Rank:
        """Build rank 0's shard (in step with the workers building theirs), then wait until every
        worker is ready. A failure on any rank closes everything and raises."""
        try:
            rank0 = build_rank(spec, comm=self.comm, generator=generator, release_hooks=self.before_group_end)
            self._await("ready", GROUP_TIMEOUT_S)
        except BaseException as e:
            self.fail(e)
        return rank0

    def _start_watchdog(self) -> None:
        """A thread that ends the group (an abort) as soon as a worker exits (see the module
        docstring), until :meth:`close` stops it."""
        stop = threading.Event()
        sentinels = [p.sentinel for p in self.procs]

        def watch():
            while not stop.is_set():
                if multiprocessing.connection.wait(sentinels, timeout=0.1) and not stop.is_set():
                    self._end_group(abort=True)
                    return

        thread = threading.Thread(target=watch, name="pagedflash-tp-watchdog", daemon=True)
        thread.start()
        self._watchdog = (thread, stop)

    def _end_group(self, *, abort: bool) -> None:
        """Release what holds the group (:attr:`before_group_end`), then abort it (a broken group:
        stalled kernels end) or destroy it; once, from any thread."""
        import torch.distributed as dist

        with self._group_lock:
            if not self._owns_group:
                return
            self._owns_group = False
            try:
                for release in self.before_group_end:
                    release()
            finally:  # a release that raised must not leave the group standing
                if dist.is_initialized():
                    aborter = getattr(dist.distributed_c10d, "_abort_process_group", None)
                    if abort and aborter is not None:
                        aborter()
                    else:
                        dist.destroy_process_group()

    # ------------------------------------------------------------------ shutdown
    def close(self, reason: str = "closed by LLM.close()", *, failed: bool = False) -> None:
        """Stop the workers (asked first, then terminated, then killed) and end the group: destroyed,
        or aborted after a failure; left alone when the watchdog is stuck in an abort. Idempotent."""
        if self.closed is not None:
            return
        stuck = False
        if self._watchdog is not None:  # workers exit below: that is no failure
            thread, stop = self._watchdog
            stop.set()
            if thread is not threading.current_thread():
                thread.join(timeout=JOIN_S)
                stuck = thread.is_alive()  # inside an abort that does not return
            self._watchdog = None
        if stuck:
            failed = True
            warnings.warn("pagedflash: the tensor-parallel group's abort did not return; the engine is closed "
                          "and its group left as it is (this process cannot start another group)", stacklevel=2)
        if not failed and self._owns_group and self.device.type == "cuda":
            with contextlib.suppress(WorkerError):  # a worker found dead here closes as failed
                self.wait_device()  # the steps in flight end before the communicator does
            if self.closed is not None:
                return
        self.closed = reason
        bye = pickle.dumps(("close", ()))
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(bye)
        deadline = time.perf_counter() + (0.5 if failed else JOIN_S)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.perf_counter()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        if not stuck:
            self._end_group(abort=failed and self.device.type == "cuda")  # a broken step's kernels would block a destroy

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


@contextlib.contextmanager
def _held_interrupts():
    """Hold SIGINT (Ctrl-C) until the block ends, then raise it; a second SIGINT raises at once.
    Outside the main thread (no signal handlers there) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []

    def handler(signum, frame):
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


# ---------------------------------------------------------------------- worker side
def _worker_main(rank: int, spec: EngineSpec, port: int, conn, parent_pid: int) -> None:
    """A worker's whole life: join the group, build the shard, follow rank 0's steps until told to
    close or rank 0 is gone; report an exception before exiting. Ctrl-C in a terminal reaches every
    process of the group: workers ignore it, rank 0 decides (it holds it, or closes the engine)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(parent_pid)
    try:
        import torch.distributed as dist

        device = spec.device_of(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, torch.get_num_threads() // spec.tensor_parallel_size))
        store = dist.TCPStore("127.0.0.1", port, spec.tensor_parallel_size, False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        conn.send(("joined", None))
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(_backend(spec), store=store, rank=rank, world_size=spec.tensor_parallel_size,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S), **kw)
        comm = make_collectives(spec.tensor_parallel_size, kind=spec.all_reduce, dtype=spec.dtype, device=device,
                                invariant=spec.batch_invariant)
        runner = build_rank(spec, rank=rank, comm=comm).runner
        conn.send(("ready", None))
        with testing.row_exact_dot_from_env():
            _follow(runner, conn)
    except EOFError:
        pass  # rank 0 is gone
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        os._exit(1)
    os._exit(0)  # no interpreter teardown: a communicator's destructor may wait on a peer


def _follow(runner, conn) -> None:
    """Run each step rank 0 sends, until ``close``."""
    with torch.inference_mode(), validate.value_checks(False):
        while True:
            name, args = pickle.loads(conn.recv_bytes())
            if name == "close":
                return
            getattr(runner, name)(*args)


def _watch_parent(parent_pid: int) -> None:
    """Exit this process once its parent (rank 0) is gone, whatever the main thread is blocked in."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pagedflash-parent-watch", daemon=True).start()

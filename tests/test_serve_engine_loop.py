"""The server's engine loop on a stand-in engine whose steps take no device time: it sleeps when
idle (no busy loop), a client that reads nothing holds up no step, admission is all or nothing,
and ``--max-queue`` counts what waits. The real engine behind HTTP is tests/test_serve.py's."""

import asyncio
import os
import threading
import time
import types

import pytest

pytest.importorskip("prometheus_client")

from pagedflash.engine.sampling import SamplingParams  # noqa: E402
from pagedflash.engine.sequence import RequestOutput  # noqa: E402
from pagedflash.entrypoints.openai.engine_loop import EngineLoop, QueueFullError, RequestRejected  # noqa: E402
from pagedflash.entrypoints.openai.metrics import EngineMetrics  # noqa: E402


class StandInLLM:
    """add_request / step / abort_request / has_unfinished_requests as the LLM has them; each step
    gives every request one token (``max_num_seqs`` at a time, the rest wait) after ``step_s``."""

    def __init__(self, step_s=0.001, max_num_seqs=64):
        self.step_s, self.max_num_seqs = step_s, max_num_seqs
        self.requests = {}
        self.num_ids = 0
        self.steps = 0
        self.scheduler = types.SimpleNamespace(waiting=[], running=[], num_preemptions=0)
        self.block_manager = types.SimpleNamespace(num_free_blocks=100,
                                                   stats=types.SimpleNamespace(queried_tokens=0, hit_tokens=0))
        self.num_blocks = 100

    def add_request(self, ids, params):
        if not ids:
            raise ValueError("prompt is empty")
        self.num_ids += 1
        self.requests[self.num_ids] = (list(ids), params, [])
        self.scheduler.waiting.append(self.num_ids)
        return self.num_ids

    def has_unfinished_requests(self):
        return bool(self.requests)

    def abort_request(self, rid):
        for q in (self.scheduler.waiting, self.scheduler.running):
            if rid in q:
                q.remove(rid)
        return self.requests.pop(rid, None) is not None

    def step(self):
        time.sleep(self.step_s)
        self.steps += 1
        s = self.scheduler
        while s.waiting and len(s.running) < self.max_num_seqs:
            s.running.append(s.waiting.pop(0))
        outs = []
        for rid in list(s.running):
            ids, params, gen = self.requests[rid]
            gen.append(7)
            done = len(gen) >= params.max_tokens
            outs.append(RequestOutput(rid, [7], done, "length" if done else None, 0, ids + gen, len(ids)))
            if done:
                self.abort_request(rid)
        return outs


@pytest.fixture
def loop_and_engine():
    llm = StandInLLM()
    engine = EngineLoop(llm, metrics=EngineMetrics("m"))
    engine.start()
    yield engine, llm
    engine.stop()
    assert not engine.alive


async def drain(queue, until_finished=1):
    events, finished = [], 0
    while finished < until_finished:
        event = await asyncio.wait_for(queue.get(), 30)
        events.append(event)
        finished += event[0] == "error" or event[3] is not None
    return events


def thread_cpu_seconds(native_id):
    """User + system CPU time of one thread of this process (Linux /proc)."""
    fields = open(f"/proc/self/task/{native_id}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread CPU time from Linux /proc")
def test_idle_loop_sleeps(loop_and_engine):
    engine, llm = loop_and_engine

    async def one():
        queue = asyncio.Queue()
        await engine.submit([[1, 2]], SamplingParams(max_tokens=3), queue)
        return await drain(queue)

    assert [e[2] for e in asyncio.run(one())] == [[7], [7], [7]]
    steps, cpu = llm.steps, thread_cpu_seconds(engine._thread.native_id)
    time.sleep(1.0)
    assert llm.steps == steps  # no step without work
    assert thread_cpu_seconds(engine._thread.native_id) - cpu < 0.05  # asleep, not polling


def test_a_client_that_reads_nothing_holds_up_no_step(loop_and_engine):
    engine, llm = loop_and_engine

    async def two():
        slow, fast = asyncio.Queue(), asyncio.Queue()
        await engine.submit([[1]], SamplingParams(max_tokens=200), slow)
        await engine.submit([[2]], SamplingParams(max_tokens=50), fast)
        events = await drain(fast)  # the slow one's queue is never read meanwhile
        return events, slow.qsize()

    events, unread = asyncio.run(two())
    assert sum(len(e[2]) for e in events) == 50
    assert unread >= 50  # its tokens kept coming, waiting in its own queue


def test_admission_is_all_or_nothing_and_max_queue_counts_waiting():
    llm = StandInLLM(step_s=0.05, max_num_seqs=1)
    engine = EngineLoop(llm, max_queue=2)
    engine.start()
    try:
        async def run():
            queue = asyncio.Queue()
            with pytest.raises(RequestRejected) as info:  # the second prompt is bad: neither runs
                await engine.submit([[1], []], SamplingParams(max_tokens=5), queue)
            assert info.value.index == 1 and "empty" in str(info.value)
            assert not llm.requests
            await engine.submit([[1]], SamplingParams(max_tokens=100), queue)
            for _ in range(2):  # its second token: the counts published after its first step are out
                await asyncio.wait_for(queue.get(), 30)
            ids = await engine.submit([[2], [3]], SamplingParams(max_tokens=100), queue)  # two wait
            with pytest.raises(QueueFullError, match="2 requests are waiting"):
                await engine.submit([[4]], SamplingParams(max_tokens=1), queue)
            engine.abort(ids)
            deadline = time.monotonic() + 30
            while True:  # room again once the loop applied the aborts and published the counts
                try:
                    return await engine.submit([[4]], SamplingParams(max_tokens=1), asyncio.Queue())
                except QueueFullError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)

        asyncio.run(run())
    finally:
        engine.stop()


def test_params_one_per_prompt(loop_and_engine):
    """A submission's params: one for all its prompts, or one each (``n`` choices with their seeds)."""
    engine, llm = loop_and_engine

    async def run():
        queue = asyncio.Queue()
        ids = await engine.submit([[1], [1], [2]], [SamplingParams(max_tokens=n, seed=n) for n in (1, 2, 3)], queue)
        events = await drain(queue, until_finished=3)
        return ids, events

    ids, events = asyncio.run(run())
    assert [sum(len(e[2]) for e in events if e[1] == i) for i in range(3)] == [1, 2, 3]
    assert len(ids) == 3 and not llm.requests


def test_stop_fails_what_is_in_flight(loop_and_engine):
    engine, llm = loop_and_engine

    async def run():
        queue = asyncio.Queue()
        await engine.submit([[1]], SamplingParams(max_tokens=10_000), queue)
        await asyncio.wait_for(queue.get(), 30)
        threading.Thread(target=engine.stop).start()
        events = await drain(queue)
        return events[-1]

    last = asyncio.run(run())
    assert last[0] == "error" and "shut down" in last[2]
    assert not llm.requests


def test_an_engine_that_closed_itself_makes_the_loop_unhealthy(loop_and_engine):
    """A step raising WorkerError (a tensor-parallel rank died; the engine closed itself): every
    request in flight gets an error, the loop refuses new ones and reports itself not alive
    (``/health`` 503) instead of answering each later request with a 500."""
    from pagedflash.engine.workers import WorkerError
    from pagedflash.entrypoints.openai.engine_loop import EngineClosedError

    engine, llm = loop_and_engine

    async def run():
        a, b = asyncio.Queue(), asyncio.Queue()
        await engine.submit([[1]], SamplingParams(max_tokens=10_000), a)
        await asyncio.wait_for(a.get(), 30)

        def dead():
            raise WorkerError("tensor-parallel rank 1 died")

        llm.step = dead
        await engine.submit([[2]], SamplingParams(max_tokens=10_000), b)
        events = [await drain(q) for q in (a, b)]
        with pytest.raises(EngineClosedError):
            await engine.submit([[3]], SamplingParams(max_tokens=1), asyncio.Queue())
        return events

    events = asyncio.run(run())
    assert all(e[-1][0] == "error" and "rank 1 died" in e[-1][2] for e in events)
    assert not engine.alive and not engine.accepting


class CompilingLLM(StandInLLM):
    """A stand-in whose grammar compile waits for ``gate`` (and raises where a schema says ``"bad"``);
    its add_request refuses a structured request whose grammar it did not compile, as the engine's
    would recompile it on the loop thread."""

    def __init__(self, slow=None):
        super().__init__()
        self.gate, self.started, self.compiled, self.threads = threading.Event(), threading.Event(), set(), set()
        self.compiles = 0
        self.slow = slow  # the one schema that waits for the gate (None: every one)

    def compile_grammar(self, params):
        self.threads.add(threading.current_thread().name)
        self.compiles += 1
        if self.slow is None or params.structured_outputs.json == self.slow:
            self.started.set()
            assert self.gate.wait(30)
        if params.structured_outputs.json == {"bad": 1}:
            raise ValueError("structured_outputs.json: xgrammar cannot compile it: bad")
        self.compiled.add(repr(params.structured_outputs))

    def grammar_compiled(self, params):
        return repr(params.structured_outputs) in self.compiled

    def add_request(self, ids, params):
        if params.structured_outputs is not None:
            if params.structured_outputs.json == {"bad": 1}:
                raise ValueError("structured_outputs.json: xgrammar cannot compile it: bad")
            assert self.grammar_compiled(params), "compiled on the loop thread"
        return super().add_request(ids, params)


async def compile_started(llm, timeout=30):
    """Until the stand-in's first gated compile began (at most ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not llm.started.is_set():
        assert time.monotonic() < deadline, "no grammar compile started"
        await asyncio.sleep(0.01)


def structured(schema, max_tokens=3):
    from pagedflash.engine.structured import StructuredOutputsParams
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=schema))


def test_a_grammar_compiles_off_the_loop():
    """A structured submission's grammar compiles on a grammar thread while the loop goes on stepping
    the requests already running; it is then admitted, counted as unfinished meanwhile."""
    llm = CompilingLLM()
    engine = EngineLoop(llm)
    engine.start()
    try:
        async def run():
            running = asyncio.Queue()
            ids = await engine.submit([[1]], SamplingParams(max_tokens=10_000), running)
            await asyncio.wait_for(running.get(), 30)
            queue = asyncio.Queue()
            admitted = asyncio.ensure_future(engine.submit([[2], [3]], structured({"type": "object"}), queue))
            await compile_started(llm)
            steps, deadline = llm.steps, time.monotonic() + 30
            while llm.steps < steps + 20:  # the running request keeps stepping while the grammar compiles
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert not admitted.done()
            assert engine.num_unfinished == 3  # the running one and the two compiling
            llm.gate.set()
            await asyncio.wait_for(admitted, 30)
            events = await drain(queue, until_finished=2)
            engine.abort(ids)
            return events

        events = asyncio.run(run())
        assert sum(len(e[2]) for e in events) == 6
        assert len(llm.threads) == 1 and next(iter(llm.threads)).startswith("pagedflash-grammar")
        assert llm.compiles == 1  # one params object for both prompts: compiled once

        async def again():  # the same grammar (another params object): admitted at once, no compile
            queue = asyncio.Queue()
            await engine.submit([[4]], structured({"type": "object"}, max_tokens=2), queue)
            return await drain(queue)

        assert sum(len(e[2]) for e in asyncio.run(again())) == 2 and llm.compiles == 1
    finally:
        llm.gate.set()
        engine.stop()


def test_a_slow_grammar_holds_up_no_other():
    """A grammar that compiles for long holds one of the grammar threads: a structured submission after
    it, with another schema, is compiled, admitted and served meanwhile."""
    llm = CompilingLLM(slow={"type": "array"})
    engine = EngineLoop(llm)
    engine.start()
    try:
        async def run():
            slow = asyncio.ensure_future(engine.submit([[1]], structured({"type": "array"}), asyncio.Queue()))
            await compile_started(llm)
            queue = asyncio.Queue()
            await asyncio.wait_for(engine.submit([[2]], structured({"type": "object"}), queue), 30)
            events = await drain(queue)
            assert not slow.done()  # still compiling
            llm.gate.set()
            await asyncio.wait_for(slow, 30)
            return events

        assert sum(len(e[2]) for e in asyncio.run(run())) == 3
        assert len(llm.threads) == 2 and llm.compiles == 2
    finally:
        llm.gate.set()
        engine.stop()


def test_a_grammar_the_compiler_refuses_rejects_the_submission():
    llm = CompilingLLM()
    llm.gate.set()
    engine = EngineLoop(llm)
    engine.start()
    try:
        async def run():
            with pytest.raises(RequestRejected, match="structured_outputs.json: xgrammar cannot compile it") as info:
                await engine.submit([[1], [2]], [SamplingParams(max_tokens=2), structured({"bad": 1})], asyncio.Queue())
            assert info.value.index == 1 and not llm.requests  # all or nothing, as for any refused prompt
            assert llm.compiles == 1  # on the grammar thread; add_request refused it again

        asyncio.run(run())
    finally:
        engine.stop()


def test_max_queue_counts_the_submissions_compiling():
    llm = CompilingLLM()
    engine = EngineLoop(llm, max_queue=2)
    engine.start()
    try:
        async def run():
            admitted = asyncio.ensure_future(engine.submit([[1], [2]], structured({"type": "object"}), asyncio.Queue()))
            await compile_started(llm)
            with pytest.raises(QueueFullError, match="2 requests are waiting"):
                await engine.submit([[3]], SamplingParams(max_tokens=1), asyncio.Queue())
            llm.gate.set()
            return await asyncio.wait_for(admitted, 30)

        assert len(asyncio.run(run())) == 2
    finally:
        llm.gate.set()
        engine.stop()


def test_stop_while_a_grammar_compiles():
    from pagedflash.entrypoints.openai.engine_loop import EngineClosedError

    llm = CompilingLLM()
    engine = EngineLoop(llm)
    engine.start()
    try:
        async def run():
            admitted = asyncio.ensure_future(engine.submit([[1]], structured({"type": "object"}), asyncio.Queue()))
            await compile_started(llm)
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            with pytest.raises(EngineClosedError, match="shut down"):
                await asyncio.wait_for(admitted, 30)

        asyncio.run(run())
        assert not engine.alive and not llm.requests
    finally:
        llm.gate.set()
        engine.stop()

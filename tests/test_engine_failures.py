"""A forward that fails or is interrupted leaves the prefix cache and the page pool as if the step
never ran: no page whose K/V it did not finish writing can be hit later, no page leaks.

Each case makes one layer raise at a chosen call (prefill, chunked prefill, decode, a step launched
ahead, ``prompt_logits``), then checks the pool is whole and that later requests give a fresh
engine's tokens. Random weights with a wide init so that stale K/V changes the argmax. A captured
CUDA graph does not call the Python layers, so these engines decode eagerly; a failing graph replay
has its own case (runnable on the CPU through an eager stand-in for capture)."""

import gc
import weakref

import pytest
import torch

from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine import runner as runner_mod
from pagedflash.engine.config import TINY_LLAMA
from pagedflash.ops import scratch

MODEL = {**TINY_LLAMA, "vocab_size": 128, "max_position_embeddings": 256, "initializer_range": 0.3}


def engine(**kwargs) -> LLM:
    return LLM(MODEL, dtype=torch.float32, seed=0, **kwargs)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _EagerGraph:
    """A captured graph's stand-in on the CPU: its replay runs the step eagerly."""

    def __init__(self, body) -> None:
        self.replay = body


def fail_layer(llm: LLM, layer: int, at_call: int, exc=KeyboardInterrupt):
    """Make ``layer`` raise ``exc`` on its ``at_call``-th call (0-based) from now on, once."""
    module = llm.model.model.layers[layer]
    real, calls = module.forward, [0]

    def forward(*args, **kwargs):
        calls[0] += 1
        if calls[0] - 1 == at_call:
            raise exc(f"injected failure in layer {layer}, call {at_call}")
        return real(*args, **kwargs)

    module.forward = forward
    return calls


def restore(llm: LLM, layer: int) -> None:
    del llm.model.model.layers[layer].forward


def assert_pool_whole(llm: LLM) -> None:
    bm = llm.block_manager
    assert not llm.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} pages still held"


def test_interrupted_prompt_logits_leaves_no_stale_page():
    """The issue's reproducer: pool of 4 pages of 3, generate A, generate B, interrupt
    prompt_logits(P) in layer 1, then generate P + [40]: the pages P took by eviction held A's and
    B's K/V in layer 1 and must not be hit as P's."""
    a, b, p = tokens(8, 1), tokens(8, 2), tokens(9, 3)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm = engine(page_size=3, num_blocks=4)
    llm.generate([a], params)
    llm.generate([b], params)
    fail_layer(llm, 1, 0)
    with pytest.raises(KeyboardInterrupt):
        llm.prompt_logits([p])
    restore(llm, 1)
    assert_pool_whole(llm)
    want = engine(page_size=3, num_blocks=4).generate([p + [40]], SamplingParams(max_tokens=3, ignore_eos=True))
    got = llm.generate([p + [40]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert want[0].finish_reason == "length" and got[0].num_cached_tokens == 0
    assert got[0].token_ids == want[0].token_ids


SYSTEM = tokens(10, 100)
PROMPTS = [SYSTEM + tokens(5, 1), tokens(11, 2), SYSTEM + tokens(3, 3), tokens(4, 4)]
PARAMS = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True),
          SamplingParams(max_tokens=7, ignore_eos=True),
          SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)]
# pages of 4, 12 tokens a step: the long prompts take two chunks; 14 pages: tight enough to preempt
ENGINE = dict(page_size=4, num_blocks=14, max_num_batched_tokens=12, cuda_graphs=False)
PHASES = {  # which launch the failure lands in
    "prefill": lambda kind, batch: kind == "launch" and any(r.start == 0 for r in batch.rows),
    "chunked_prefill": lambda kind, batch: kind == "launch" and any(r.start > 0 and not r.decode and r.num_tokens > 1
                                                                    for r in batch.rows),
    "decode": lambda kind, batch: kind == "launch" and batch.is_decode_only,
    "ahead": lambda kind, batch: kind == "ahead",
    # a step launched ahead with a row whose token starts a page: its block was reserved for it
    "ahead_new_page": lambda kind, batch: kind == "ahead" and any(r.start % 4 == 0 for r in batch.rows),
}


@pytest.fixture(scope="module")
def fresh():
    """A fresh engine's tokens for the workload."""
    return [o.token_ids for o in engine(**ENGINE).generate(PROMPTS, PARAMS)]


def fail_in_phase(llm: LLM, phase: str, layer: int, exc, occurrence: int = 0) -> list:
    """Make ``layer`` raise ``exc`` in the ``occurrence``-th launch of the kind ``phase`` names."""
    runner, module = llm.runner, llm.model.model.layers[layer]
    launches, current = [], {}

    def track(kind, real):
        def launch(batch):
            current["fail"] = PHASES[phase](kind, batch) and sum(launches) == occurrence
            launches.append(PHASES[phase](kind, batch))
            return real(batch)
        return launch

    runner.launch = track("launch", runner.launch)
    runner.launch_ahead = track("ahead", runner.launch_ahead)
    real_forward = module.forward

    def forward(*args, **kwargs):
        if current.pop("fail", False):
            raise exc(f"injected: layer {layer}, {phase}")
        return real_forward(*args, **kwargs)

    module.forward = forward
    return launches


def heal(llm: LLM) -> None:
    for obj in (llm.runner, llm.model.model.layers[0], llm.model.model.layers[1]):
        for name in ("launch", "launch_ahead", "forward"):
            obj.__dict__.pop(name, None)


@pytest.mark.parametrize("phase, layer, exc", [
    ("prefill", 1, KeyboardInterrupt), ("chunked_prefill", 0, RuntimeError), ("chunked_prefill", 1, KeyboardInterrupt),
    ("decode", 1, torch.OutOfMemoryError), ("ahead", 1, KeyboardInterrupt),
], ids=lambda v: v if isinstance(v, str) else getattr(v, "__name__", str(v)))
def test_failed_generate_leaves_the_pool_whole(fresh, phase, layer, exc):
    """generate re-raises and drops its requests; the next generate gives a fresh engine's tokens."""
    llm = engine(**ENGINE)
    launches = fail_in_phase(llm, phase, layer, exc)
    with pytest.raises(exc, match="injected"):
        llm.generate(PROMPTS, PARAMS)
    assert any(launches), f"no {phase} launch"
    heal(llm)
    assert_pool_whole(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == fresh
    assert_pool_whole(llm)


@pytest.mark.parametrize("phase, occurrence", [("prefill", 1), ("chunked_prefill", 0), ("decode", 2), ("ahead", 1)])
def test_failed_step_is_retried_as_if_it_never_ran(fresh, phase, occurrence):
    """step raises, no request advanced; calling step again finishes the requests with a fresh
    engine's tokens (the failed step's pages were rewritten, none was cached half written)."""
    llm = engine(**ENGINE)
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    launches = fail_in_phase(llm, phase, 1, RuntimeError, occurrence)
    got, failures = {i: [] for i in ids}, 0
    while llm.has_unfinished_requests():
        before = {i: (s.num_computed, len(s)) for i, s in llm._requests.items()}
        try:
            outs = llm.step()
        except RuntimeError:
            failures += 1
            assert {i: (s.num_computed, len(s)) for i, s in llm._requests.items()} == before
            continue
        for out in outs:
            got[out.request_id] += out.new_token_ids
    assert failures == 1 and sum(launches) > occurrence
    assert [got[i] for i in ids] == fresh
    assert_pool_whole(llm)


def step_through_failures(llm: LLM, ids: list, exc) -> tuple[list, int]:
    """Call ``step`` until every request finished, counting the steps that raised ``exc``; after each,
    no sequence holds a block past its tokens (a reservation for a step launched ahead went back).
    Returns each request's tokens, in ``ids`` order, and the failure count."""
    got, failures, bm = {i: [] for i in ids}, 0, llm.block_manager
    while llm.has_unfinished_requests():
        try:
            outs = llm.step()
        except exc:
            failures += 1
            assert all(len(q.block_table) == -(-len(q.token_ids) // bm.page_size) for q in bm._seqs.values())
            continue
        for out in outs:
            got[out.request_id] += out.new_token_ids
    return [got[i] for i in ids], failures


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failed_step_ahead_across_a_page_gives_its_reserved_blocks_back(exc):
    """A step launched ahead whose rows start new pages (blocks reserved before their tokens) fails:
    step raises, no sequence keeps a block past its tokens, and calling step again finishes the
    requests with a fresh engine's tokens and a whole pool (greedy rows of different lengths, so
    they cross pages at different steps)."""
    prompts, params = [tokens(5, 1), tokens(7, 2), tokens(10, 3)], SamplingParams(max_tokens=9, ignore_eos=True)
    kw = dict(page_size=4, num_blocks=32, max_num_batched_tokens=12, cuda_graphs=False)
    want = [o.token_ids for o in engine(**kw).generate(prompts, params)]
    llm = engine(**kw)
    ids = [llm.add_request(p, params) for p in prompts]
    launches = fail_in_phase(llm, "ahead_new_page", 1, exc)
    got, failures = step_through_failures(llm, ids, exc)
    assert failures == 1 and sum(launches) >= 1
    assert got == want
    assert_pool_whole(llm)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failed_read_behind_a_step_ahead_across_a_page_gives_its_blocks_back(exc):
    """The step in flight fails when its tokens are read, after the step behind it was launched ahead
    with blocks reserved: the reservations go back with it (no sequence keeps a block past its tokens),
    and the requests finish with a fresh engine's tokens and a whole pool."""
    prompts, params = [tokens(n, s) for s, n in enumerate([3, 6, 9, 5])], SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(page_size=4, num_blocks=24, cuda_graphs=False)
    want = [o.token_ids for o in engine(**kw).generate(prompts, params)]
    llm = engine(**kw)
    ids, ra = [llm.add_request(p, params) for p in prompts], llm.run_ahead
    real, reserving = ra.launch_successor, []

    def launch_successor(step):
        real(step)
        if ra._ahead is not None and ra._ahead.reserved:
            reserving.append(step)
            if len(reserving) == 2:
                def fail():
                    raise exc("injected: reading the tokens")
                step.pending.result = fail

    ra.launch_successor = launch_successor
    got, failures = step_through_failures(llm, ids, exc)
    assert failures == 1
    assert got == want
    assert_pool_whole(llm)


def test_no_step_ahead_past_the_longest_sequence():
    """A prompt of exactly max_model_len tokens whose last chunk is one token (a prefix hit) samples
    its one token; nothing is launched ahead at position max_model_len (past the positions the model
    and the block tables hold)."""
    prefix = tokens(8, 5)
    llm = engine(page_size=4, num_blocks=16, cuda_graphs=False, max_model_len=9)
    llm.generate([prefix + [20]], SamplingParams(max_tokens=1, ignore_eos=True))
    out = llm.generate([prefix + [21]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.num_cached_tokens == 8 and len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_pool_whole(llm)


def test_failed_prompt_logits_then_requests_hit_only_written_pages(fresh):
    """prompt_logits fails after evicting cached pages; generate afterwards equals a fresh engine's."""
    llm = engine(**ENGINE)
    llm.generate(PROMPTS[:2], PARAMS[:2])
    fail_layer(llm, 1, 0, RuntimeError)
    with pytest.raises(RuntimeError, match="injected"):
        llm.prompt_logits([PROMPTS[2], tokens(30, 9)])  # takes every page: evicts the cached ones
    restore(llm, 1)
    assert_pool_whole(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == fresh
    other = engine(**ENGINE)
    torch.testing.assert_close(llm.prompt_logits([PROMPTS[2]])[0], other.prompt_logits([PROMPTS[2]])[0])
    assert other.generate([PROMPTS[2]], PARAMS[2])[0].num_cached_tokens == 12  # completed: its pages cached


def test_failed_graph_replay_is_retried(fresh, monkeypatch):
    """A decode step whose graph replay raises: retried, the requests end with a fresh engine's tokens."""
    if not torch.cuda.is_available():  # capture stands in for a graph: replay reruns the captured body
        monkeypatch.setattr(runner_mod, "capture", lambda body, pool: (_EagerGraph(body), pool))
    llm = engine(**{**ENGINE, "cuda_graphs": True})
    if not llm.runner.graphs:
        llm.runner.capture_graphs()
    replays = []

    class FailOnce:
        def __init__(self, graph):
            self.graph = graph

        def replay(self):
            replays.append(len(replays))
            if len(replays) == 3:
                raise RuntimeError("injected: graph replay")
            self.graph.replay()

    llm.runner.graphs = {bs: FailOnce(g) for bs, g in llm.runner.graphs.items()}
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    got, failures = {i: [] for i in ids}, 0
    while llm.has_unfinished_requests():
        try:
            outs = llm.step()
        except RuntimeError:
            failures += 1
            continue
        for out in outs:
            got[out.request_id] += out.new_token_ids
    assert failures == 1 and len(replays) > 3
    assert [got[i] for i in ids] == fresh
    assert_pool_whole(llm)


def test_graphs_are_captured_after_a_collection_with_the_collector_paused(monkeypatch):
    """A dropped engine's graphs destroyed during another engine's capture would invalidate it (a
    destroy is refused while a stream captures): capture_graphs collects first, keeps the collector
    off until its last capture, then restores it. On the CPU capture is an eager stand-in."""
    events, real_collect = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: events.append(("collect", gc.isenabled())) or real_collect())
    real = runner_mod.capture

    def capture(body, pool):
        events.append(("capture", gc.isenabled()))
        if torch.cuda.is_available():
            return real(body, pool)
        return _EagerGraph(body), pool

    monkeypatch.setattr(runner_mod, "capture", capture)
    llm = engine(**{**ENGINE, "cuda_graphs": True})
    events.clear()
    llm.runner.capture_graphs()
    assert events[0] == ("collect", True) and len(events) > 1
    assert all(e == ("capture", False) for e in events[1:]) and gc.isenabled()
    gc.disable()  # a caller's choice is kept
    try:
        llm.runner.capture_graphs()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_a_graph_collected_during_a_capture_cannot_break_it(monkeypatch):
    """Before each of the engine's captures a captured graph is left in a reference cycle and the
    collector set to run at the next allocation: were it on, that graph would be destroyed mid-capture
    and the capture fail (and every later random draw in the process raise)."""
    real, buf = runner_mod.capture, torch.zeros(1, device="cuda")

    def capture(body, pool):
        dead = torch.cuda.CUDAGraph()
        with torch.cuda.graph(dead):
            buf.add_(1)
        cycle = [dead]
        cycle.append(cycle)
        del cycle, dead
        thresholds = gc.get_threshold()
        gc.set_threshold(1)
        try:
            return real(body, pool)
        finally:
            gc.set_threshold(*thresholds)

    monkeypatch.setattr(runner_mod, "capture", capture)
    llm = engine(**{**ENGINE, "cuda_graphs": True})
    assert llm.runner.graphs
    torch.randn(4, device="cuda")
    outs = llm.generate(PROMPTS[:2], PARAMS[:2])
    assert all(o.finish_reason == "length" for o in outs)


def test_a_closed_engine_refuses_every_call():
    """After ``close()`` every call raises one clear RuntimeError (no AttributeError from the released
    runner, no request accepted); ``close()`` again does nothing; ``prompt_logits([])`` is ``[]``."""
    llm = engine(num_blocks=8)
    assert llm.prompt_logits([]) == []
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    request = llm.add_request(tokens(5, 1), params)
    llm.close()
    llm.close()
    calls = {
        "add_request": lambda: llm.add_request(tokens(5, 2), params),
        "step": llm.step,
        "generate": lambda: llm.generate([tokens(5, 3)], params),
        "prompt_logits": lambda: llm.prompt_logits([tokens(5, 4)]),
        "abort_request": lambda: llm.abort_request(request),
        "has_unfinished_requests": llm.has_unfinished_requests,
    }
    for call in calls.values():
        with pytest.raises(RuntimeError, match=r"the engine is closed \(LLM.close\(\) was called\)"):
            call()


def _largest_blocks(count: int = 3) -> str:
    """The GPU allocator's largest segments now: whether a live tensor holds each (its block's
    allocation frames in pagedflash or its tests) or a CUDA graph's private pool keeps it."""
    segments = sorted(torch.cuda.memory._snapshot().get("segments", []), key=lambda s: -s.get("total_size", 0))
    lines = []
    for seg in segments[:count]:
        live = [b for b in seg.get("blocks", []) if b.get("state") == "active_allocated"]
        frames = [f"{f.get('filename', '?').rsplit('/', 2)[-1]}:{f.get('line')} {f.get('name')}"
                  for b in live[:1] for f in b.get("frames", []) if "pagedflash" in f.get("filename", "")
                  or "tests" in f.get("filename", "")][:6]
        lines.append(f"\n  segment of {seg.get('total_size', 0)} bytes, pool {seg.get('segment_pool_id')}, "
                     f"{len(live)} live blocks ({seg.get('active_size', 0)} bytes){': ' if frames else ''}"
                     + " <- ".join(frames))
    return "".join(lines)


def _settled_memory() -> tuple[int, int]:
    """(allocated, reserved) bytes on the GPU once collected garbage, the library's reused launch
    buffers and cuBLAS's per-stream workspaces are gone and the allocator's cache emptied."""
    gc.collect()
    scratch.clear()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_a_closed_engine_keeps_no_memory(monkeypatch, request, invariant):
    """``close()`` releases the KV pool, the weights and the CUDA graphs (with the mode's split
    partials: a model length past the 4,096-key head) while the closed LLM is still referenced, as
    ``bench serve`` builds the next engine before its name lets go of the last: nothing of them stays
    reachable, and on a GPU the allocated and reserved bytes come back. On the CPU capture is the
    eager stand-in (its replay closures hold what a graph's would)."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        monkeypatch.setattr(runner_mod, "capture", lambda body, pool: (_EagerGraph(body), pool))
    before = _settled_memory() if on_gpu else None
    if on_gpu:  # allocation stacks, for the message of a failure below
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        request.addfinalizer(lambda: torch.cuda.memory._record_memory_history(enabled=None))
    llm = LLM({**MODEL, "max_position_embeddings": 8192}, dtype=torch.bfloat16 if on_gpu else torch.float32,
              seed=0, num_blocks=65536 if on_gpu else 64, cuda_graphs=True, batch_invariant=invariant)
    if not on_gpu:
        llm.runner.capture_graphs()
    assert llm.runner.graphs
    llm.generate([tokens(40, 1), tokens(7, 2)], SamplingParams(max_tokens=6, ignore_eos=True))
    pool, pool_bytes = weakref.ref(llm.kv_cache.kv), llm.kv_cache.kv.nbytes
    weights = weakref.ref(llm.model.lm_head.weight)
    graph = weakref.ref(next(iter(llm.runner.graphs.values())))
    llm.close()
    kept = [name for name, ref in (("pool", pool), ("weights", weights), ("a graph", graph)) if ref() is not None]
    holders = [] if pool() is None else [type(r).__name__ for r in gc.get_referrers(pool())]
    assert not kept, f"a closed engine keeps {kept} (the pool held by {holders})"
    if on_gpu:
        allocated, reserved = _settled_memory()
        slack = min(64 << 20, pool_bytes // 4)  # (the pool is 256 MB)
        held = f"{allocated - before[0]} bytes allocated, {reserved - before[1]} reserved after close()"
        assert allocated - before[0] < slack and reserved - before[1] < slack, held + _largest_blocks()
    del llm

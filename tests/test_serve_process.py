"""``pagedflash serve --engine-process``: the engine loop in a child process, behind the same HTTP
server. :mod:`test_serve`'s behaviours that cross the process boundary (the openai client streamed
and not, a disconnect, concurrent streams against offline ``generate``, /metrics, admission
errors, SIGTERM drain), :mod:`test_serve_sampling`'s that do (``n`` with per-choice seeds and its
abort, ``echo`` with prompt logprobs, ``logit_bias``), plus a child that dies.
"""

import asyncio
import os
import signal
import threading
import time

import pytest
from test_serve import GREEDY, MODEL, TIMEOUT, LiveServer, finished, httpx, openai, serve_process
from test_serve_sampling import SAMPLED, finish_reasons, streamed_texts

from pagedflash.engine.config import TINY_LLAMA
from pagedflash.engine.llm import LLM
from pagedflash.engine.sampling import SamplingParams
from pagedflash.entrypoints.openai.engine_process import EngineProcess


class ProcessServer(LiveServer):
    """A :class:`LiveServer` whose engine runs in a child process (read only through /metrics)."""

    def __init__(self, *argv):
        super().__init__("--engine-process", *argv)
        assert isinstance(self.state.engine, EngineProcess)

    def assert_pool_whole(self):
        assert self.wait_idle()[("pagedflash:kv_cache_usage_perc", frozenset())] == 0.0

    def stop(self):
        super().stop()
        assert not self.state.engine.process.is_alive()


@pytest.fixture(scope="module")
def server():
    s = ProcessServer("--max-num-seqs", "16")
    yield s
    s.stop()


def test_openai_client_completions_and_chat_streamed_and_not(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=3, **GREEDY)
    assert whole.usage.completion_tokens == 3 and whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert len(chunks) == 3 + 1 and chunks[-1].usage.completion_tokens == 3
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text

    messages = [{"role": "user", "content": "Hello, world!"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    assert chat.usage.completion_tokens == 2 and chat.choices[0].message.role == "assistant"
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                   **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content

    batch = client.completions.create(model=MODEL, prompt=[[5, 6], [7, 8, 9]], max_tokens=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.completion_tokens == 4


def test_disconnect_aborts_and_frees_the_pool(server):
    before = server.wait_idle()
    body = {"prompt": [7, 8, 9], "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    after = server.wait_idle()
    assert finished(after, "abort") == finished(before, "abort") + 1
    assert after[("pagedflash:generation_tokens_total", frozenset())] - \
        before[("pagedflash:generation_tokens_total", frozenset())] < 500
    server.assert_pool_whole()


def test_n_echo_and_logit_bias(server):
    """Per-choice seeds and prompt logprobs cross the pipe: a request with a thread's engine loop
    would give the same choices; disconnecting aborts every choice."""
    client = server.client()
    tok = server.state.tokenizer
    ids = tok.encode("The quick brown fox")
    echo = tok.decode(ids, skip_special_tokens=False)  # ids echo with their special tokens (the BOS)
    asked = dict(model=MODEL, prompt=ids, max_tokens=2, n=3, seed=21, echo=True, logprobs=1, **SAMPLED)
    whole = client.completions.create(**asked)
    assert [c.index for c in whole.choices] == [0, 1, 2] and len({c.text for c in whole.choices}) > 1
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 6
    for c in whole.choices:
        assert c.text.startswith(echo) and len(c.logprobs.tokens) == len(ids) + 2
        assert c.logprobs.token_logprobs[0] is None and all(x <= 0 for x in c.logprobs.token_logprobs[1:])
    chunks = list(client.completions.create(**asked, stream=True))
    assert streamed_texts(chunks) == {c.index: c.text for c in whole.choices}
    assert finish_reasons(chunks) == {i: ["length"] for i in range(3)}
    alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, seed=22, **SAMPLED)
    assert whole.choices[1].text == echo + alone.choices[0].text

    biased = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, logit_bias={"42": 100}, **GREEDY)
    assert biased.choices[0].text == tok.decode([42] * 3)

    before = server.wait_idle()
    body = {"prompt": [7, 8, 9], "max_tokens": 500, "n": 2, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    after = server.wait_idle()
    assert finished(after, "abort") == finished(before, "abort") + 2
    server.assert_pool_whole()


def test_concurrent_streams_equal_offline_generate_and_metrics_count(server):
    prompts = [[3 + (7 * i + j) % 500 for j in range(1 + i % 4)] for i in range(12)]
    max_tokens = [1 + i % 3 for i in range(12)]
    before = server.wait_idle()
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)

    async def one(prompt, n):
        text = ""
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
        return text

    async def all_of_them():
        return await asyncio.wait_for(asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens))), 300)

    texts = asyncio.run(all_of_them())
    offline = LLM(TINY_LLAMA, seed=0, num_blocks=256, max_num_batched_tokens=256)
    want = offline.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens])
    assert texts == [server.state.tokenizer.decode(out.token_ids) for out in want]
    after = server.wait_idle()

    def moved(name, labels=frozenset()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("pagedflash:prompt_tokens_total") == sum(map(len, prompts))
    assert moved("pagedflash:generation_tokens_total") == sum(max_tokens)
    assert moved("pagedflash:prefix_cache_queries_total") == sum(map(len, prompts))
    assert finished(after, "length") - finished(before, "length") == len(prompts)
    assert moved("pagedflash:time_to_first_token_seconds_count") == len(prompts)
    assert moved("pagedflash:inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens)
    assert moved("pagedflash:e2e_request_latency_seconds_count") == len(prompts)
    server.assert_pool_whole()


def test_refusals_then_a_dead_engine_process_fails_requests_and_the_health_check():
    """The engine's refusal (a 400) and --max-queue (a 503) across the pipe; then the child is killed:
    the running request gets a 500, the queued stream an error event, /health and new requests 503."""
    s = ProcessServer("--num-gpu-blocks-override", "63", "--block-size", "16",  # a pool of 1,008 tokens
                      "--max-num-seqs", "1", "--max-queue", "1")
    try:
        r = s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 1020})  # 64 pages
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # the engine's RequestRejected
        assert "KV pages" in r.json()["error"]["message"]
        result = {}

        def request():
            # long enough to be still running at the kill on a GPU too (a step of the tiny model: ~1 ms)
            result["r"] = s.post("/v1/completions", {"prompt": [4, 5], "max_tokens": 1000, "ignore_eos": True})

        t = threading.Thread(target=request)
        t.start()
        deadline = time.monotonic() + 60
        while s.metrics()[("pagedflash:generation_tokens_total", frozenset())] == 0:  # running
            assert time.monotonic() < deadline
            time.sleep(0.05)
        body = {"prompt": [9, 10], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=TIMEOUT) as waiting:
            assert waiting.status_code == 200  # admitted to the engine's queue behind the running one
            r = s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
            s.state.engine.process.kill()
            lines = [line for line in waiting.iter_lines() if line.startswith("data:")]
        assert "engine process died" in lines[-2] and lines[-1] == "data: [DONE]"
        t.join(TIMEOUT)
        assert result["r"].status_code == 500 and "engine process died" in result["r"].json()["error"]["message"]
        assert httpx.get(s.url + "/health", timeout=TIMEOUT).status_code == 503
        r = s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 503, r.text
        assert s.state.engine.num_unfinished == 0
    finally:
        s.stop()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the engine process through /proc")
def test_sigterm_drains_then_stops_the_engine_process():
    proc, url = serve_process("--engine-process")
    children = []
    try:
        children = _children(proc.pid)
        assert children, "no engine process"
        body = {"prompt": [11, 12], "max_tokens": 5, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"completion_tokens":5' in rest[-2]  # finished, not cut
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in children):  # the engine process, and multiprocessing's helper
            assert time.monotonic() < deadline, f"left behind: {[pid for pid in children if _running(pid)]}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

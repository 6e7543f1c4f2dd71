"""The HTTP server (``pagedflash serve``) live on 127.0.0.1: the official ``openai`` client, raw HTTP
for bad input, disconnects, concurrency against offline ``generate``, 503 under ``--max-queue``, an
injected step failure, ``/metrics``, the API key, SIGTERM drain.

The tiny random Llama runs under the Triton interpreter (a step of one row takes ~0.3 s on CPU), so
prompts are short and requests generate few tokens; every client call has a timeout.
"""

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("jinja2")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from helpers import child_env  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pagedflash.engine.config import TINY_LLAMA  # noqa: E402
from pagedflash.engine.llm import LLM  # noqa: E402
from pagedflash.engine.sampling import SamplingParams  # noqa: E402
from pagedflash.entrypoints.openai import api_server  # noqa: E402

TIMEOUT = 120.0  # seconds, any one HTTP call
MODEL = api_server.TINY_MODEL_NAME


class LiveServer:
    """An in-process server on a free loopback port (uvicorn in a thread), its engine loop a thread
    (``--no-engine-process``: the tests reach into the engine) unless ``argv`` says otherwise."""

    def __init__(self, *argv):
        args = api_server.parse_args(["--port", "0", "--no-engine-process", *argv])
        self.state = api_server.build_state(args)
        app = api_server.build_app(self.state, api_key=args.api_key)
        self.server = api_server.make_server(app, log_level="warning")
        sock = api_server.bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy in 60 s"
            time.sleep(0.1)

    @property
    def llm(self):
        return self.state.engine.llm

    def client(self, **kwargs):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), timeout=TIMEOUT,
                             max_retries=0, **kwargs)

    def post(self, path, body=None, *, content=None, **kwargs):
        return httpx.post(self.url + path, json=body, content=content, timeout=TIMEOUT, **kwargs)

    def metrics(self) -> dict:
        """{(name, frozenset(labels other than model_name)): value} of every sample."""
        text = httpx.get(self.url + "/metrics", timeout=TIMEOUT).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
                out[(s.name, labels)] = s.value
        return out

    def request_counts(self) -> dict:
        """The engine's requests running and waiting, and those finished by reason (a failure's context)."""
        return {f"{name}{dict(labels) or ''}": value for (name, labels), value in self.metrics().items()
                if name.startswith(("pagedflash:num_requests_", "pagedflash:request_success_total"))}

    def wait_idle(self, timeout=60.0):
        """Until the engine holds no request (read through /metrics: the loop thread owns the engine)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m[("pagedflash:num_requests_running", frozenset())] == 0
                    and m[("pagedflash:num_requests_waiting", frozenset())] == 0
                    and self.state.engine.num_unfinished == 0):
                return m
            assert time.monotonic() < deadline, "engine still busy"
            time.sleep(0.1)

    def assert_pool_whole(self):
        m = self.wait_idle()
        assert m[("pagedflash:kv_cache_usage_perc", frozenset())] == 0.0
        assert self.llm.block_manager.num_free_blocks == self.llm.num_blocks  # idle: the loop thread waits

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive()
        assert not self.state.engine.alive


def finished(m, reason):
    return m.get(("pagedflash:request_success_total", frozenset({("finished_reason", reason)})), 0.0)


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-num-seqs", "32")
    yield s
    s.stop()


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@contextlib.contextmanager
def slow_steps(server: LiveServer, seconds: float = 0.05):
    """Each engine step of ``server`` (its loop thread's ``llm.step``) takes at least ``seconds``, so
    that a request of a few tokens still runs when a test acts on it: on a GPU the tiny model's step
    takes ~1 ms, under the interpreter ~0.3 s."""
    llm = server.llm
    real = llm.step

    def step():
        outputs = real()
        time.sleep(seconds)
        return outputs

    llm.step = step
    try:
        yield
    finally:
        del llm.step


# ------------------------------------------------------------------ the openai client
def test_openai_client_completions_streamed_and_not(server):
    client = server.client()
    prompt = "The quick brown fox"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY)
    n_prompt = len(server.state.tokenizer.encode(prompt))
    assert whole.usage.prompt_tokens == n_prompt and whole.usage.completion_tokens == 4
    assert whole.usage.total_tokens == n_prompt + 4
    assert whole.choices[0].finish_reason == "length"

    times, texts, chunks = [], [], []
    with slow_steps(server):
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True,
                                               stream_options={"include_usage": True}, **GREEDY):
            times.append(time.monotonic())
            chunks.append(chunk)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert len(chunks) == 4 + 1  # a chunk per token (one a step), text or not, then usage
    texts = [c.choices[0].text for c in chunks[:-1]]
    assert "".join(texts) == whole.choices[0].text  # greedy: the same tokens
    assert chunks[-2].choices[0].finish_reason == "length"
    assert times[-1] - times[0] > 0.1  # the first chunk came while the request still ran

    batch = client.completions.create(model=MODEL, prompt=[[5, 6], [7, 8, 9]], max_tokens=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.prompt_tokens == 5
    assert batch.usage.completion_tokens == 4
    texts = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt=[[5, 6], [7, 8, 9]], max_tokens=2, stream=True,
                                           **GREEDY):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in batch.choices]


def test_openai_client_chat_streamed_and_not(server):
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello, world!"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, **GREEDY)
    prompt_text = server.state.tokenizer.render_chat(messages)
    n_prompt = len(server.state.tokenizer.encode(prompt_text, add_special_tokens=False))
    assert whole.usage.prompt_tokens == n_prompt and whole.usage.completion_tokens == 3
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and len(chunks) == 1 + 3 + 1  # role, a token each, usage
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"] and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == n_prompt and chunks[-1].usage.completion_tokens == 3
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_stop_strings_and_stop_token_ids(server):
    client = server.client()
    ids = [5, 17, 42]
    base = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY).choices[0].text
    stop = next((base[i:i + 2] for i in range(1, len(base) - 1) if "\ufffd" not in base[i:i + 2]), None)
    if stop is not None:
        e2e = ("pagedflash:e2e_request_latency_seconds_count", frozenset())
        before = server.wait_idle()[e2e]
        cut = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, stop=[stop], **GREEDY)
        assert cut.choices[0].text == base[:base.find(stop)] and cut.choices[0].finish_reason == "stop"
        assert server.wait_idle()[e2e] == before + 1  # a request a stop string ended is timed too
        streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, stop=stop, stream=True, **GREEDY)
        assert "".join(c.choices[0].text for c in streamed) == base[:base.find(stop)]
    # a stop token id ends the request with it (its token counted): every id stops at the first
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"stop_token_ids": list(range(512))})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1


def test_special_tokens_in_the_text(server):
    """vLLM's ``skip_special_tokens``: a special token the model emits (BOS, forced by a bias) is left
    out of the text by default and written with false, streamed or not; the stop id that ends a
    request is never written, and is counted."""
    from pagedflash.entrypoints.openai.tokenizer import TextTokenizer

    client = server.client()
    body = dict(model=MODEL, prompt=[5, 17, 42], max_tokens=3, temperature=0, logit_bias={"1": 100})
    out = client.completions.create(**body)
    assert out.choices[0].text == "" and out.usage.completion_tokens == 3
    written = TextTokenizer.tiny().decode([1, 1, 1], skip_special_tokens=False)
    assert "<s>" in written
    keep = {"skip_special_tokens": False}
    assert client.completions.create(**body, extra_body=keep).choices[0].text == written
    streamed = client.completions.create(**body, extra_body=keep, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == written
    out = client.completions.create(**body, extra_body={**keep, "stop_token_ids": [1]})
    assert (out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens) == ("", "stop", 1)
    # vLLM's include_stop_str_in_output: the ending stop id written, a matched stop string kept
    include = {**keep, "stop_token_ids": [1], "include_stop_str_in_output": True}
    out = client.completions.create(**body, extra_body=include)
    assert (out.choices[0].text, out.usage.completion_tokens) == (written[:len(written) // 3], 1)
    base = client.completions.create(model=MODEL, prompt=[5, 17, 42], max_tokens=6, temperature=0).choices[0].text
    stop = next((base[i:i + 2] for i in range(1, len(base) - 1) if "\ufffd" not in base[i:i + 2]), None)
    if stop is not None:
        out = client.completions.create(model=MODEL, prompt=[5, 17, 42], max_tokens=6, temperature=0, stop=[stop],
                                        extra_body={"include_stop_str_in_output": True})
        assert out.choices[0].text == base[:base.find(stop) + 2] and out.choices[0].finish_reason == "stop"


def test_logprobs_completions_and_chat(server):
    """Greedy: each token's logprob is the largest at its position; streamed equal to not streamed."""
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, logprobs=2, **GREEDY)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3 == whole.usage.completion_tokens
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp <= 0 and abs(token_lp - max(top.values())) < 1e-6 and 1 <= len(top) <= 3
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=3, logprobs=2, stream=True, **GREEDY)]
    assert [t for x in streamed for t in x.tokens] == lp.tokens
    assert [t for x in streamed for t in x.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [t for x in streamed for t in x.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True, top_logprobs=2,
                                          **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.bytes == list(entry.token.encode())
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True,
                                            top_logprobs=2, stream=True, **GREEDY)
    tokens = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **GREEDY)
    assert plain.choices[0].logprobs is None


# ------------------------------------------------------------------ bad input
BAD = [
    ("/v1/completions", b'{"prompt": ', None),
    ("/v1/completions", b'[1, 2]', None),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": 123}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt[1]"),
    ("/v1/completions", {"prompt": [1, 600]}, "prompt"),
    ("/v1/completions", {"prompt": [1] * 1024}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -3}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"512": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"7": 1, "07": 2}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {" 7": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "seed": 2**64 - 1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": -1}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1.5": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3},
     "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0].function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),
]


def assert_400(server, path, body, param) -> dict:
    """POST ``body`` (a dict, or raw bytes); the response is a 400 naming ``param``: its error body."""
    r = server.post(path, content=body) if isinstance(body, bytes) else server.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error
    return error


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    assert_400(server, path, body, param)


def test_unknown_route_and_method_have_error_bodies(server):
    r = httpx.get(server.url + "/v1/nothing", timeout=TIMEOUT)
    assert r.status_code == 404 and "message" in r.json()["error"]
    r = httpx.get(server.url + "/v1/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and "message" in r.json()["error"]


# ------------------------------------------------------------------ engine loop behaviour
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_disconnect_aborts_and_frees_the_pool(server, stream):
    before = server.wait_idle()
    body = {"prompt": [7, 8, 9], "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
    else:  # the client gives up waiting and closes the connection
        with slow_steps(server), pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=1.5))
    after = server.wait_idle()  # the abort reached the engine well before 500 tokens
    assert finished(after, "abort") == finished(before, "abort") + 1
    assert after[("pagedflash:generation_tokens_total", frozenset())] - \
        before[("pagedflash:generation_tokens_total", frozenset())] < 500
    server.assert_pool_whole()


def test_concurrent_streams_equal_offline_generate(server):
    """32 streams of mixed prompt and output lengths at once; each complete, with the greedy tokens
    of offline ``generate`` on the same prompts (compared as text and token counts)."""
    prompts = [[3 + (7 * i + j) % 500 for j in range(1 + i % 4)] for i in range(32)]
    max_tokens = [1 + (i // 4) % 3 for i in range(32)]  # 1-3: the interpreter's decode step of 32 rows takes seconds
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)

    async def one(prompt, n):
        text, usage = "", None
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage
        return text, usage

    async def all_of_them():
        return await asyncio.wait_for(asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens))), 600)

    results = asyncio.run(all_of_them())
    offline = LLM(TINY_LLAMA, seed=0, num_blocks=256, max_num_batched_tokens=256)
    want = offline.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens])
    for (text, usage), out, prompt in zip(results, want, prompts):
        assert usage.completion_tokens == len(out.token_ids) and usage.prompt_tokens == len(prompt)
        assert text == server.state.tokenizer.decode(out.token_ids)
    server.assert_pool_whole()


def test_injected_step_failure_fails_its_requests_and_the_server_goes_on(server, monkeypatch):
    llm = server.llm
    real_step = llm.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:  # the second step: the request has its first token
            raise RuntimeError("injected fault")
        return real_step()

    before = server.wait_idle()
    monkeypatch.setattr(llm, "step", failing_step)
    r = server.post("/v1/completions", {"prompt": [4, 5, 6], "max_tokens": 5, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert "injected fault" in error["message"] and error["type"] == "internal_server_error"
    r = server.post("/v1/completions", {"prompt": [4, 5, 6], "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    after = server.wait_idle()
    assert finished(after, "error") == finished(before, "error") + 1
    server.assert_pool_whole()


def test_metrics_in_prometheus_format_count_exactly(server):
    """Two equal 20-token prompts one after the other: the counters move by exactly their tokens,
    and the second finds the first's full page (16 tokens) in the prefix cache."""
    before = server.wait_idle()
    for _ in range(2):
        r = server.post("/v1/completions", {"prompt": list(range(30, 50)), "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200
    after = server.wait_idle()
    names = {name for name, _ in after}
    for suffix in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                   "generation_tokens_total", "num_preemptions_total", "request_success_total",
                   "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                   "e2e_request_latency_seconds_count"):
        assert "pagedflash:" + suffix in names

    def moved(name, labels=frozenset()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("pagedflash:prompt_tokens_total") == 40
    assert moved("pagedflash:prefix_cache_queries_total") == 40
    assert moved("pagedflash:prefix_cache_hits_total") == 16
    assert moved("pagedflash:generation_tokens_total") == 4
    assert finished(after, "length") - finished(before, "length") == 2
    for hist, count in (("time_to_first_token", 2), ("inter_token_latency", 2), ("e2e_request_latency", 2)):
        assert moved(f"pagedflash:{hist}_seconds_count") == count
        assert moved(f"pagedflash:{hist}_seconds_sum") > 0
    assert after[("pagedflash:num_preemptions_total", frozenset())] == 0


# ------------------------------------------------------------------ other configurations
def test_queue_full_is_a_503():
    s = LiveServer("--max-num-seqs", "1", "--max-queue", "1")
    try:
        r = s.post("/v1/completions", {"prompt": [[1, 2], [3, 4]], "max_tokens": 1})  # can never fit: no retry
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = s.post("/v1/completions", {"prompt": [1, 2], "n": 2, "max_tokens": 1})  # n requests in the engine
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        body = {"prompt": [9, 10], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with slow_steps(s), httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=TIMEOUT) as running:
            next(line for line in running.iter_lines() if line.startswith("data:"))  # admitted and running
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=TIMEOUT) as waiting:
                assert waiting.status_code == 200  # admitted to the queue (headers come after admission)
                r = s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
                assert r.status_code == 503, (r.text, s.request_counts())
                assert r.json()["error"]["code"] == "queue_full"
        s.assert_pool_whole()
    finally:
        s.stop()


def test_api_key_and_a_request_larger_than_the_pool():
    s = LiveServer("--api-key", "sesame", "--num-gpu-blocks-override", "8", "--block-size", "4")  # 32 tokens
    try:
        r = s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 200}, headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"  # the engine's refusal
        assert "KV pages" in r.json()["error"]["message"]
        r = s.post("/v1/completions", {"prompt": [5] * 29, "ignore_eos": True}, headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4  # the default: what the pool holds
        body = {"prompt": [1, 2], "max_tokens": 1}
        assert s.post("/v1/completions", body).status_code == 401
        r = s.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert s.client(api_key="sesame").completions.create(model=MODEL, prompt=[1, 2], max_tokens=1).usage
        chunks = s.client(api_key="sesame").completions.create(model=MODEL, prompt=[1, 2], max_tokens=2, stream=True)
        assert len(list(chunks)) == 2
        assert httpx.get(s.url + "/health", timeout=TIMEOUT).status_code == 200
    finally:
        s.stop()


def test_nodelay_is_set_on_accepted_sockets():
    listener = api_server.bind("127.0.0.1", 0)
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()

    class Transport:
        def get_extra_info(self, name):
            return conn if name == "socket" else None

    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 0)
    api_server.set_nodelay(Transport())
    assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    for sock in (conn, client, listener):
        sock.close()


def serve_process(*args, timeout=120.0):
    """``python -m pagedflash serve --port 0 *args`` in a subprocess, once ``/health`` answers 200:
    (the process, its URL). Its output is read in a thread (the pipe never fills)."""
    proc = subprocess.Popen([sys.executable, "-m", "pagedflash", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "server exited before listening"
            if " on http://" in line:
                url = line.split(" on ")[1].split()[0]
        assert url is not None
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        while httpx.get(url + "/health", timeout=TIMEOUT).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def test_sigterm_drains_in_flight_requests_and_exits_0():
    proc, url = serve_process("--no-engine-process")
    try:
        body = {"prompt": [11, 12], "max_tokens": 6, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            try:  # no new request: the listener is closed (or, before it closed, a 503)
                late = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=TIMEOUT)
                assert late.status_code == 503, late.text
            except httpx.ConnectError:
                pass
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and '"completion_tokens":6' in rest[-2]  # finished, not cut
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_command_errors(tmp_path, capsys):
    assert api_server.main([str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert api_server.main(["--port", "0", "--chat-template", "no-such-file"]) == 2
    assert "--chat-template: expected a file or a Jinja template" in capsys.readouterr().err
    taken = api_server.bind("127.0.0.1", 0)
    try:
        assert api_server.main(["--port", str(taken.getsockname()[1])]) == 2
        assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
    finally:
        taken.close()
    with pytest.raises(SystemExit):
        api_server.parse_args(["--max-queue", "0"])

"""``pagedflash serve`` with its engine in a child process (the default) whose engine failed for good
(a :class:`~pagedflash.engine.WorkerError`: a tensor-parallel rank died, the engine closed itself)
while the child lives on: the requests in flight get an error, ``/health`` answers 503 and later
requests 503, none hangs. (A child that dies: :mod:`test_serve_process`.)"""

import time

import pytest
from engine_faults import FailingSteps
from test_serve import TIMEOUT, httpx
from test_serve_process import ProcessServer

from pagedflash.entrypoints.openai import api_server

QUICK = 30.0  # seconds: an answer after the failure comes within one loop iteration


@pytest.fixture
def failing_server(monkeypatch):
    """A server whose engine process fails its 4th step on."""
    parse = api_server.parse_args

    def parse_with_fault(argv):
        args = parse(argv)
        args.injected_fault = FailingSteps(after=3)  # unpickled in the engine process: it installs itself
        return args

    monkeypatch.setattr(api_server, "parse_args", parse_with_fault)
    s = ProcessServer("--max-num-seqs", "4")
    yield s
    s.stop()


def test_a_failed_engine_process_fails_requests_and_the_health_check(failing_server):
    s = failing_server
    r = s.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2  # steps 1 and 2
    assert httpx.get(s.url + "/health", timeout=TIMEOUT).status_code == 200
    body = {"prompt": [5, 6], "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=QUICK) as streamed:
        assert streamed.status_code == 200
        lines = [line for line in streamed.iter_lines() if line.startswith("data:")]
    assert '"text"' in lines[0]  # step 3: its first token; step 4 failed
    assert "rank 1 died" in lines[-2] and lines[-1] == "data: [DONE]"
    deadline = time.monotonic() + QUICK
    assert httpx.get(s.url + "/health", timeout=QUICK).status_code == 503
    for stream in (False, True):
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "stream": stream},
                       timeout=QUICK)
        assert r.status_code == 503 and "rank 1 died" in r.json()["error"]["message"], r.text
    assert time.monotonic() < deadline
    assert s.state.engine.process.is_alive() and s.state.engine.num_unfinished == 0

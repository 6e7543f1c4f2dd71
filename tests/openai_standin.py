"""A stand-in OpenAI-compatible streaming server with known timings, for the load generator's tests.

``POST /v1/completions`` (stream only) waits ``ttft_s``, then sends ``max_tokens`` fake tokens in
chunks of ``tokens_per_chunk``, ``itl_s`` apart per chunk, the last chunk with ``finish_reason``,
then a usage chunk (``choices: []``) and ``data: [DONE]``. ``usage_per_chunk`` adds running usage to
every chunk (vLLM's continuous usage stats). A request whose ``max_tokens`` equals
``fail_max_tokens`` gets HTTP 500. Prompt tokens: the length of a token-id list, else the words of
the text. It records each request's arrival time and the requests in flight as it arrived (itself
included), and the most in flight at once.
``GET /health``, ``GET /v1/models`` (one model, ``standin``). TCP_NODELAY on every connection.

Run as a script (``python tests/openai_standin.py --host 127.0.0.1 --port N [--ttft-ms X]
[--itl-ms Y] [--ignore-sigterm]``) it serves until SIGTERM, then exits 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def setup(self):
        super().setup()
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args):  # quiet
        pass

    def _json(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "standin", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):
        s = self.server
        arrived = time.perf_counter()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with s.lock:
            s.arrivals.append(arrived)
            s.bodies.append(body)
            s.auth.append(self.headers.get("Authorization"))
            s.inflight += 1
            s.inflight_at_arrival.append(s.inflight)
            s.max_inflight = max(s.max_inflight, s.inflight)
        self._in_flight = True
        try:
            self._complete(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
            pass
        finally:
            self._leave()

    def _leave(self) -> None:
        """The request stops counting as in flight: before its last write, since a client may send its
        next request as soon as it reads that (else a capped client seems one over its cap)."""
        if self._in_flight:
            self._in_flight = False
            with self.server.lock:
                self.server.inflight -= 1

    def _complete(self, body: dict) -> None:
        s = self.server
        n = body["max_tokens"]
        if n == s.fail_max_tokens:
            self._leave()
            self._json(500, {"error": {"message": "injected failure", "type": "InternalServerError"}})
            return
        prompt = body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(s.ttft_s)
        sent = 0
        while sent < n:
            k = min(s.tokens_per_chunk, n - sent)
            sent += k
            chunk = {"object": "text_completion", "choices": [
                {"index": 0, "text": "x" * k, "finish_reason": "length" if sent == n else None}]}
            if s.usage_per_chunk:
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if sent < n:
                time.sleep(s.itl_s)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        self._leave()
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


class StandIn(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default backlog of 5 drops concurrent connects (a 1 s SYN retry)

    def __init__(self, port: int = 0, *, ttft_s: float = 0.05, itl_s: float = 0.01, tokens_per_chunk: int = 1,
                 usage_per_chunk: bool = False, fail_max_tokens: int | None = None):
        super().__init__(("127.0.0.1", port), Handler)
        self.ttft_s, self.itl_s, self.tokens_per_chunk = ttft_s, itl_s, tokens_per_chunk
        self.usage_per_chunk, self.fail_max_tokens = usage_per_chunk, fail_max_tokens
        self.lock = threading.Lock()
        self.arrivals: list[float] = []
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []  # each request's Authorization header
        self.inflight_at_arrival: list[int] = []
        self.inflight = self.max_inflight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--ignore-sigterm", action="store_true", help="a server that hangs on shutdown")
    args = p.parse_args()
    if args.host != "127.0.0.1":
        raise SystemExit("the stand-in serves on 127.0.0.1 only")
    server = StandIn(args.port, ttft_s=args.ttft_ms / 1e3, itl_s=args.itl_ms / 1e3)
    on_term = signal.SIG_IGN if args.ignore_sigterm else (lambda *_: threading.Thread(target=server.shutdown).start())
    signal.signal(signal.SIGTERM, on_term)
    server.serve_forever(poll_interval=0.05)
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``pagedflash serve [MODEL_DIR]``: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events
or not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), and vLLM's ``POST /tokenize``
and ``POST /detokenize`` (:mod:`.tokenize`). One engine loop runs the
engine, in a child process by default (:mod:`.engine_process`: the engine's host work shares no GIL
with the HTTP handlers) or, with ``--no-engine-process``, in a thread (:mod:`.engine_loop`); the handlers (:mod:`.serving`) only validate, tokenize,
detokenize and format. Without ``MODEL_DIR`` the tiny random Llama
(:data:`~pagedflash.engine.config.TINY_LLAMA`) with the tiny tokenizer is served, so the server
starts on any machine (on a CPU under the Triton interpreter: slow, for tests and trials).

Streams: each accepted connection gets TCP_NODELAY, so a small event is sent at once. SIGTERM or
SIGINT: new requests get 503 and the listening socket closes; requests in flight finish, or are
aborted after ``--shutdown-timeout`` seconds; the process exits 0.

(No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations, which name
classes imported inside :func:`build_app`.)
"""

import argparse
import asyncio
import contextlib
import functools
import hmac
import logging
import os
import signal
import socket
import sys

from pagedflash.entrypoints.openai import protocol as p
from pagedflash.entrypoints.openai import responses, serving, tokenize, tools
from pagedflash.entrypoints.openai.serving import APIError, ServerState

logger = logging.getLogger("pagedflash.serve")
TINY_MODEL_NAME = "pagedflash-tiny-llama"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, named as vLLM's ``serve`` names them where they mean the same."""
    ap = argparse.ArgumentParser(prog="pagedflash serve", description="OpenAI-compatible HTTP server on the pagedflash engine.")
    ap.add_argument("model", nargs="?", default=None,
                    help="local Hugging Face model directory (config.json, *.safetensors, tokenizer.json); "
                         "default: the tiny random Llama with a small tokenizer")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    ap.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL_DIR)")
    ap.add_argument("--tokenizer", default=None, help="directory or tokenizer.json (default: MODEL_DIR's)")
    ap.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='chat tool_choice "auto": parse the model\'s tool calls (needs --tool-call-parser)')
    ap.add_argument("--tool-call-parser", default=None, choices=sorted(tools.PARSERS),
                    help="the format the model writes its tool calls in (hermes: Qwen 2.5/3, Hermes; llama3_json: "
                         "Llama 3.1-3.3; mistral: Mistral 7B v0.3, Nemo, Small)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    ap.add_argument("--max-queue", type=int, default=None,
                    help="requests waiting for admission at most; more get 503 (default: no limit)")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="on SIGTERM, seconds to let requests in flight finish before aborting them")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                    help="run the engine loop in a child process (the HTTP process keeps tokenizing, "
                         "detokenizing and streaming; no GIL shared with the engine's host work); "
                         "--no-engine-process: in a thread of the HTTP process")
    ap.add_argument("--request-timeline", default=None, metavar="PATH",
                    help="append one JSON line per request to PATH: its time stamps from the HTTP handler "
                         "through the engine to the first token sent (see pagedflash.entrypoints.openai.timeline; "
                         "summarize with python -m pagedflash.bench.timeline PATH); default: off")
    engine = ap.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8 (fp8_e4m3) or fp8_e5m2")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--dtype", default=None, help="float32, float16 or bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None, help="KV pages in the pool")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--batch-invariant", action="store_true",
                        help="a request's tokens and logprobs the same whatever else is served "
                             "(LLM(batch_invariant=True); README 'Batch invariance')")
    args = ap.parse_args(argv)
    if args.max_queue is not None and args.max_queue < 1:
        ap.error(f"--max-queue must be >= 1 (a new request waits until a step admits it), got {args.max_queue}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        ap.error("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes its calls in)")
    if args.shutdown_timeout < 0:
        ap.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    return args


def build_llm(args: argparse.Namespace):
    """The :class:`~pagedflash.engine.LLM` the options describe (built in the engine process with
    ``--engine-process``)."""
    import torch

    from pagedflash.engine.config import TINY_LLAMA
    from pagedflash.engine.llm import LLM

    kwargs = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, dtype=args.dtype,
                  kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
                  enable_prefix_caching=args.enable_prefix_caching, page_size=args.block_size,
                  num_blocks=args.num_gpu_blocks_override, gpu_memory_utilization=args.gpu_memory_utilization,
                  cuda_graphs=not args.enforce_eager, seed=args.seed, batch_invariant=args.batch_invariant)
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    # the engine's tokenizer: the vocabulary structured outputs compile against
    kwargs["tokenizer"] = args.tokenizer
    if args.model is not None:
        return LLM(args.model, **kwargs)
    if args.tokenizer is None:
        from pagedflash.entrypoints.openai.tokenizer import tiny_tokenizer

        kwargs["tokenizer"] = tiny_tokenizer(TINY_LLAMA["vocab_size"])
    if not torch.cuda.is_available():  # the engine demo's CPU sizes: the interpreter is slow
        kwargs.setdefault("max_num_batched_tokens", 256)
        kwargs["num_blocks"] = kwargs["num_blocks"] or 256
    return LLM(TINY_LLAMA, **kwargs)


def engine_limits(llm) -> dict:
    """The served model's limits that :class:`ServerState` holds, from the engine."""
    return dict(max_model_len=llm.max_model_len, vocab_size=llm.config.vocab_size,
                pool_tokens=llm.num_blocks * llm.page_size)


def build_state(args: argparse.Namespace) -> ServerState:
    """Load the engine (in a process of its own with ``args.engine_process``) and the tokenizer; the
    engine loop is built, not started."""
    from pagedflash.engine.config import TINY_LLAMA
    from pagedflash.entrypoints.openai.engine_loop import EngineLoop
    from pagedflash.entrypoints.openai.metrics import EngineMetrics
    from pagedflash.entrypoints.openai.timeline import RequestTimeline
    from pagedflash.entrypoints.openai.tokenizer import TextTokenizer, load_chat_template

    if args.model is not None and not os.path.isdir(args.model):
        raise FileNotFoundError(f"model directory {args.model!r} does not exist (nothing is fetched from a hub)")
    chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    if args.model is None:
        tokenizer = (TextTokenizer.from_model_dir(args.tokenizer, chat_template=chat_template) if args.tokenizer
                     else TextTokenizer.tiny(TINY_LLAMA["vocab_size"], chat_template=chat_template))
        name = args.served_model_name or TINY_MODEL_NAME
    else:
        tokenizer = TextTokenizer.from_model_dir(args.tokenizer or args.model, chat_template=chat_template)
        name = args.served_model_name or args.model
    metrics = EngineMetrics(name)
    in_process = getattr(args, "engine_process", False)
    path = getattr(args, "request_timeline", None)
    try:
        timeline = None if path is None else RequestTimeline(path, "process" if in_process else "thread")
    except OSError as e:
        raise FileNotFoundError(f"--request-timeline {path!r} cannot be opened for appending: {e}") from None
    if in_process:
        from pagedflash.entrypoints.openai.engine_process import EngineProcess

        engine = EngineProcess(args, metrics=metrics, max_queue=args.max_queue)
        limits = engine.limits
    else:
        llm = build_llm(args)
        engine = EngineLoop(llm, metrics=metrics, max_queue=args.max_queue, timeline=timeline is not None)
        limits = engine_limits(llm)
    return ServerState(engine=engine, tokenizer=tokenizer, model_name=name, timeline=timeline,
                       tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None, **limits)


def build_app(state: ServerState, *, api_key: str | None = None):
    """The FastAPI app over ``state``; starting it starts the engine loop, stopping it stops the loop."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not state.engine.alive:
            state.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine.stop)
            if state.timeline is not None:
                state.timeline.close()

    app = FastAPI(title="pagedflash", lifespan=lifespan)
    app.state.serving = state

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def on_api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def on_http_error(request, e: HTTPException):
        return error_response(APIError(e.status_code, str(e.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def on_unexpected(request, e: Exception):
        logger.exception("unexpected error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", type="internal_server_error"))

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        class Authenticate:
            """A pure ASGI middleware (a streamed response passes through untouched, disconnects included)."""

            def __init__(self, app):
                self.app = app

            async def __call__(self, scope, receive, send):
                if scope["type"] == "http" and scope["path"].startswith("/v1"):
                    given = dict(scope["headers"]).get(b"authorization", b"")
                    if not hmac.compare_digest(given, expected):
                        refusal = APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                           code="invalid_api_key")
                        return await error_response(refusal)(scope, receive, send)
                await self.app(scope, receive, send)

        app.add_middleware(Authenticate)

    class GenerationStream(StreamingResponse):
        """Server-sent events of a generation, whose prompts are aborted however the response ends
        (a client gone before the first event never starts the body's generator)."""

        def __init__(self, body, gen: serving.Generation):
            super().__init__(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.gen = gen

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.gen.abort_unfinished()

    async def respond(request: Request, gen: serving.Generation, make):
        try:
            return await make(gen, request.receive, state.model_name)
        except serving.ClientGone:
            return Response(status_code=499)

    def begin_timeline() -> dict | None:
        return None if state.timeline is None else state.timeline.begin()

    @app.post("/v1/completions")
    async def completions(request: Request):
        stamps = begin_timeline()
        body = parse_body(p.CompletionRequest, await request.body())
        serving.check_request(state, body)
        prompts = serving.completion_prompts(state, body)
        params = serving.sampling_params(state, body, max(len(x) for x in prompts),
                                         default_max_tokens=serving.DEFAULT_COMPLETION_MAX_TOKENS)
        echo = serving.echo_texts(state, body, prompts) if body.echo else None
        gen = serving.Generation(state, prompts, params, serving.stop_strings(body),
                                 keep_output=not serving.echo_only(body), structured_field=serving.structured_field(body),
                                 timeline=stamps and {**stamps, "stream": body.stream},
                                 skip_special_tokens=body.skip_special_tokens,
                                 include_stop=body.include_stop_str_in_output)
        await gen.start()
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return GenerationStream(responses.completion_stream(gen, state.model_name, usage, echo=echo), gen)
        return await respond(request, gen, functools.partial(responses.completion_response, echo=echo))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        stamps = begin_timeline()
        body = parse_body(p.ChatCompletionRequest, await request.body())
        serving.check_request(state, body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise serving.bad_request("give max_completion_tokens or max_tokens, not both", param="max_tokens")
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        plan = serving.tool_plan(state, body)
        prompt = serving.chat_prompt(state, body)
        constraint = plan.constraint(body.tools or [])
        params = serving.sampling_params(state, body, len(prompt), default_max_tokens=None, max_tokens_field=field,
                                         structured=constraint)
        gen = serving.Generation(state, [prompt], params, serving.stop_strings(body),
                                 structured_field="tools" if constraint else serving.structured_field(body),
                                 timeline=stamps and {**stamps, "stream": body.stream},
                                 skip_special_tokens=body.skip_special_tokens and plan.mode != "auto",
                                 include_stop=body.include_stop_str_in_output)
        await gen.start()
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return GenerationStream(responses.chat_stream(gen, state.model_name, usage, plan), gen)
        return await respond(request, gen, functools.partial(responses.chat_response, plan=plan))

    @app.post("/tokenize")
    async def create_tokenize(request: Request):
        return tokenize.tokenize(state, parse_body(tokenize.TokenizeRequest, await request.body()))

    @app.post("/detokenize")
    async def create_detokenize(request: Request):
        return tokenize.detokenize(state, parse_body(tokenize.DetokenizeRequest, await request.body()))

    @app.get("/v1/models")
    async def models():
        return p.ModelList(data=[p.ModelCard(id=state.model_name, max_model_len=state.max_model_len)])

    @app.get("/health")
    async def health():  # 503 once shutting down, or if the engine loop died
        return Response(status_code=200 if state.engine.alive and state.engine.accepting else 503)

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def parse_body(model, raw: bytes):
    """The JSON body as ``model`` (whatever the Content-Type says), or a 400 naming the first bad field."""
    import pydantic

    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


def validation_error(e) -> APIError:
    """A pydantic error of a request body, as a 400 naming the first bad field."""
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = list(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}",
                        code="invalid_json")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {first.get('msg')}", code="invalid_body")
    param = str(loc[0])
    for part in loc[1:]:  # indices, and field names; a union's member tags ("str", "list[int]") are left out
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS and not part[0].isupper():
            param += f".{part}"
    given = first.get("input")
    shown = repr(given)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    message = f"{param}: {first.get('msg')}" + ("" if kind == "missing" else f" (got {shown})")
    return APIError(400, message, param=param, code=kind or None)


# ------------------------------------------------------------------ running
def set_nodelay(transport) -> None:
    """TCP_NODELAY on a transport's socket (a small write goes out at once, not after the peer's ACK)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _nodelay_protocol():
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class NoDelayHTTPProtocol(AutoHTTPProtocol):
        def connection_made(self, transport):
            set_nodelay(transport)
            super().connection_made(transport)

    return NoDelayHTTPProtocol


def make_server(app, *, shutdown_timeout: float = 30.0, log_level: str = "info"):
    """A uvicorn server for ``app`` whose SIGTERM/SIGINT stop the engine's intake and shut down
    gracefully, without re-raising the signal afterwards (so the process can exit 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            import threading

            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def on_signal(sig, frame):
                logger.info("signal %d: draining (new requests get 503, in-flight ones finish)", sig)
                app.state.serving.engine.stop_accepting()
                self.handle_exit(sig, frame)

            previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, http=_nodelay_protocol(), log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            access_log=False)
    return Server(config)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"pagedflash serve: needs the serve extra (pip install -e .[serve]): {e}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # first: a taken port is reported before a model loads
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"pagedflash serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    try:
        state = build_state(args)
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"pagedflash serve: {e}", file=sys.stderr)
        sock.close()
        return 2
    app = build_app(state, api_key=args.api_key)
    host, port = sock.getsockname()[:2]
    print(f"pagedflash serve: {state.model_name} on http://{host}:{port} (max_model_len {state.max_model_len})",
          flush=True)
    server = make_server(app, shutdown_timeout=args.shutdown_timeout)
    server.run(sockets=[sock])
    return 0

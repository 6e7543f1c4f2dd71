"""The handlers' work between HTTP and the engine loop: validate a request into token ids and
:class:`~pagedflash.engine.SamplingParams` and run it (:mod:`.responses` builds the response bodies
and stream chunks from it).

A request's ``n`` choices per prompt are ``n`` engine requests each (the prefix cache shares the
prompt's full pages); with a ``seed``, choice ``j`` of a prompt draws with ``seed + j`` (vLLM's
parallel sampling), so the choices differ and a request repeated gives the same ones. Completions
number their choices ``prompt_index * n + j``, chat ``0 .. n - 1``; ``usage`` counts each prompt's
tokens once and every choice's generated tokens. Completions' ``echo`` puts each prompt's text
before its choices' (with ``logprobs``, the prompt tokens' entries from the engine's
``prompt_logprobs`` first); with ``max_tokens: 0`` it returns the prompt alone (the engine generates
one token, which is dropped, as vLLM does).

Every refusal is an :class:`APIError` carrying the HTTP status and the OpenAI error body's fields
(``param`` names the offending field). Input never gives a 500: that status is for a step that failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedflash.engine.sampling import SamplingParams
from pagedflash.engine.structured import StructuredOutputsParams
from pagedflash.entrypoints.openai import protocol as p
from pagedflash.entrypoints.openai import tools
from pagedflash.entrypoints.openai.engine_loop import (
    EngineClosedError,
    EngineLoop,
    QueueFullError,
    RequestRejected,
)
from pagedflash.entrypoints.openai.timeline import RequestTimeline
from pagedflash.entrypoints.openai.tokenizer import ChatTemplateError, IncrementalDetokenizer, TextTokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
MAX_N = 128  # choices per prompt at most (each an engine request)


class APIError(Exception):
    """A refusal: ``status`` and the fields of the OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code if code is not None else status

    def body(self) -> dict:
        return p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code)).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class ServerState:
    """What the handlers share: the engine loop, the tokenizer, and the served model's limits."""

    engine: EngineLoop  # or an EngineProcess (``--engine-process``): the same interface
    tokenizer: TextTokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    pool_tokens: int | None = None  # tokens the KV pool holds (None: no limit below max_model_len)
    timeline: RequestTimeline | None = None  # ``--request-timeline``: where the requests' stamps go
    tool_parser: str | None = None  # ``--tool-call-parser`` with ``--enable-auto-tool-choice``: tool_choice "auto"


# ------------------------------------------------------------------ validation
def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(400, f"model {model!r} is not served here; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def check_request(state: ServerState, request: p._GenerationRequest) -> None:
    check_model(state, request.model)
    unsupported = p.unsupported_field(request)
    if unsupported is not None:
        field, why = unsupported
        raise bad_request(why, param=field, code="unsupported")
    if not 1 <= num_choices(request) <= MAX_N:
        raise bad_request(f"n must be an int in [1, {MAX_N}] (choices per prompt), got {request.n}", param="n")


def num_choices(request: p._GenerationRequest) -> int:
    return 1 if request.n is None else request.n


def check_prompt(state: ServerState, ids: list[int], param: str) -> None:
    if not ids:
        raise bad_request(f"{param} is empty", param=param)
    bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {state.vocab_size})", param=param)
    if len(ids) >= state.max_model_len:
        raise bad_request(f"{param} has {len(ids)} tokens, but the model's maximum context length is "
                          f"{state.max_model_len} (prompt plus at least one generated token)", param=param)


def echo_only(request: p._GenerationRequest) -> bool:
    """Completions' ``echo`` with ``max_tokens: 0``: the prompt alone, nothing generated."""
    return isinstance(request, p.CompletionRequest) and request.echo and request.max_tokens == 0


def sampling_params(state: ServerState, request: p._GenerationRequest, prompt_len: int, *, default_max_tokens: int | None,
                    max_tokens_field: str = "max_tokens",
                    structured: StructuredOutputsParams | None = None) -> list[SamplingParams]:
    """The request's sampling fields as SamplingParams, one per choice of a prompt (``n``; with a
    ``seed``, choice ``j``'s is ``seed + j``); ``prompt_len``: the longest prompt's tokens.
    ``structured``: the output's constraint when the request's tools set it (else its own fields')."""
    echo = isinstance(request, p.CompletionRequest) and request.echo
    if isinstance(request, p.ChatCompletionRequest):
        logprobs, logprobs_field = (request.top_logprobs or 0) if request.logprobs else None, "top_logprobs"
    else:
        logprobs, logprobs_field = request.logprobs, "logprobs"
    n = num_choices(request)
    room = state.max_model_len - prompt_len
    max_tokens = getattr(request, max_tokens_field)
    if max_tokens is None:  # the room left, in the model's length and in the whole pool (the n choices' share)
        fits = min(room, (state.pool_tokens - prompt_len) // n + 1) if state.pool_tokens else room
        max_tokens = max(1, fits if default_max_tokens is None else min(default_max_tokens, fits))
    elif max_tokens >= 1 and prompt_len + max_tokens > state.max_model_len:
        raise bad_request(f"{max_tokens_field}={max_tokens} with a prompt of {prompt_len} tokens exceeds the model's "
                          f"maximum context length {state.max_model_len} (at most {room} can be generated)",
                          param=max_tokens_field)
    elif echo_only(request):
        max_tokens = 1  # the engine's one token is dropped (:class:`Generation`'s ``keep_output``)
    top_k = request.top_k if request.top_k is not None else 0
    fields = dict(max_tokens=max_tokens, temperature=1.0 if request.temperature is None else request.temperature,
                  top_p=1.0 if request.top_p is None else request.top_p, top_k=0 if top_k == -1 else top_k,
                  min_p=0.0 if request.min_p is None else request.min_p,
                  presence_penalty=0.0 if request.presence_penalty is None else request.presence_penalty,
                  frequency_penalty=0.0 if request.frequency_penalty is None else request.frequency_penalty,
                  repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                  logit_bias=logit_bias(state, request.logit_bias),
                  seed=request.seed, ignore_eos=request.ignore_eos, stop_token_ids=list(request.stop_token_ids or ()),
                  logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                  structured_outputs=structured or structured_outputs(request))
    try:
        params = SamplingParams(**fields)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        renamed = {"max_tokens": max_tokens_field, "logprobs": logprobs_field, "prompt_logprobs": logprobs_field}
        param = renamed.get(field, field if field in fields else None)
        raise bad_request(str(e).replace(field, param, 1) if param else str(e), param=param) from None
    if n == 1:
        return [params]
    # a non-streamed echo's prompt logprobs come from the first choice alone: a request asking for them
    # recomputes its prompt (no prefix-cache hit), and the other choices then share the first's pages
    # (a stream needs each choice's entries in its own first chunk, which may come before the first's)
    shared = params.prompt_logprobs is not None and not request.stream
    try:
        return [dataclasses.replace(params, seed=None if params.seed is None else params.seed + j,
                                    prompt_logprobs=None if shared and j else params.prompt_logprobs)
                for j in range(n)]
    except ValueError as e:
        raise bad_request(f"seed: choice j of n draws with seed + j, and seed + {n - 1} is out of range: {e}",
                          param="seed") from None


def structured_field(request: p._GenerationRequest) -> str:
    """The request field that carries its output constraint (errors name it)."""
    return "response_format" if request.response_format is not None else "structured_outputs"


def structured_outputs(request: p._GenerationRequest) -> StructuredOutputsParams | None:
    """``response_format`` (``json_object``, ``json_schema``) or vLLM's ``structured_outputs`` as the
    engine's constraint; None for neither (or ``{"type": "text"}``)."""
    fmt, vllm = request.response_format, request.structured_outputs
    if fmt is not None and fmt.type == "text":
        fmt = None
    if fmt is not None and vllm is not None:
        raise bad_request("give response_format or structured_outputs, not both", param="structured_outputs")
    if fmt is not None:
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              param="response_format")
        try:
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        except ValueError as e:
            raise bad_request(re.sub(r"^structured_outputs\.json", "response_format.json_schema.schema", str(e)),
                              param="response_format") from None
    if vllm is None:
        return None
    unsupported = vllm.unsupported()
    if unsupported:
        raise bad_request(f"structured_outputs.{unsupported} is not supported", param=f"structured_outputs.{unsupported}",
                          code="unsupported")
    try:
        return StructuredOutputsParams(json=vllm.json_, json_object=bool(vllm.json_object), regex=vllm.regex,
                                       choice=vllm.choice, grammar=vllm.grammar,
                                       disable_any_whitespace=vllm.disable_any_whitespace)
    except ValueError as e:
        raise bad_request(str(e), param="structured_outputs") from None


def logit_bias(state: ServerState, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as strings) with int keys, each in the vocabulary."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias: key {key!r} is not a token id (decimal digits)", param="logit_bias")
        token = int(key) if len(key) <= 18 else state.vocab_size  # longer: past any vocabulary (and int()'s limit)
        if not token < state.vocab_size:
            raise bad_request(f"logit_bias: token id {token if len(key) <= 18 else key[:18] + '...'} is outside the vocabulary [0, {state.vocab_size})",
                              param="logit_bias")
        if token in out:
            raise bad_request(f"logit_bias: token id {token} is given twice", param="logit_bias")
        out[token] = value
    return out


def stop_strings(request: p._GenerationRequest) -> list[str]:
    stop = request.stop
    return [stop] if isinstance(stop, str) else list(stop or [])


def prompt_batch(request: p.CompletionRequest) -> list[str | list[int]]:
    """The request's prompts as given: a string, a list of ids, or a batch of either."""
    prompt = request.prompt
    return prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]


def completion_prompts(state: ServerState, request: p.CompletionRequest) -> list[list[int]]:
    """The request's prompts as token ids."""
    batch = prompt_batch(request)
    out = []
    for i, item in enumerate(batch):
        param = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{param} is empty", param=param)
            ids = state.tokenizer.encode(item)
        else:
            ids = list(item)
        check_prompt(state, ids, param)
        out.append(ids)
    return out


def echo_texts(state: ServerState, request: p.CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text for ``echo``: a string as given, token ids decoded with their special tokens
    (vLLM's: the ids are what the model saw)."""
    return [item if isinstance(item, str) else state.tokenizer.decode(ids, skip_special_tokens=False)
            for item, ids in zip(prompt_batch(request), prompts)]


def tool_plan(state: ServerState, request: p.ChatCompletionRequest) -> tools.ToolPlan:
    try:
        return tools.plan(request, state.tool_parser)
    except tools.ToolError as e:
        raise bad_request(str(e), param=e.param) from None


def chat_prompt(state: ServerState, request: p.ChatCompletionRequest, *, check: bool = True) -> list[int]:
    """The messages rendered with the chat template, as token ids; ``check``: and refused when they
    are empty or leave no room in the context for a generated token."""
    if not request.messages:
        raise bad_request("messages is empty", param="messages")
    messages = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            kinds = {part.type for part in content} - {"text"}
            if kinds:
                raise bad_request(f"messages[{i}].content: only text parts are supported, got {sorted(kinds)}",
                                  param=f"messages[{i}].content")
            content = "".join(part.text or "" for part in content)
        messages.append({**message.model_dump(exclude_none=True), "content": content or ""})
    tool_list = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    try:
        messages = tools.template_messages(
            messages, nine_char_ids=state.tool_parser == "mistral" or state.tokenizer.nine_char_tool_ids)
    except tools.ToolError as e:
        raise bad_request(str(e), param=e.param) from None
    try:
        text = state.tokenizer.render_chat(messages, add_generation_prompt=request.add_generation_prompt,
                                           tools=tool_list)
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None
    except ValueError as e:  # no template
        raise bad_request(str(e), param="messages", code="no_chat_template") from None
    ids = state.tokenizer.encode(text, add_special_tokens=False)  # the template wrote BOS if it wants one
    if check:
        check_prompt(state, ids, "messages")
    return ids


# ------------------------------------------------------------------ running
@dataclass
class Delta:
    index: int  # the choice's: ``prompt_index * n + j``
    text: str
    finish_reason: str | None
    logprobs: list[tuple[int, dict[int, float]]] | None = None  # (token id, {id: logprob}) of its tokens


class Generation:
    """One HTTP request's choices in the engine: ``params[j]`` runs choice ``j`` of every prompt
    (:func:`sampling_params`'s list: equal but for the seeds; :attr:`params` is the first),
    choice ``j`` of prompt ``i`` being engine request (and :class:`Delta` index) ``i * n + j``.
    :meth:`start` admits them all, :meth:`deltas` yields their text as it comes (one
    :class:`Delta` per engine step that gave a choice tokens, its text empty while a character or a
    possible stop string is incomplete; the last with the finish reason), :meth:`usage` counts
    tokens. Leaving :meth:`deltas` early (an error, a client gone) aborts what is still running.

    keep_output: False drops what the engine generates (completions' ``echo`` with ``max_tokens:
    0``, whose engine requests generate one token): each choice ends with no text and ``"length"``.
    timeline: the HTTP request's first stamps (:meth:`.RequestTimeline.begin`) when the server keeps
    a timeline; :meth:`deltas` completes each choice's and writes them when it ends.
    structured_field: the request field whose constraint the engine compiles (its refusal names it).
    skip_special_tokens: special tokens' text left out of the choices' text (True) or written; the
    EOS or stop id that ends a choice is counted in its tokens, not written but with ``include_stop``
    (which also keeps a matched stop string)."""

    def __init__(self, state: ServerState, prompts: list[list[int]], params: list[SamplingParams], stop: list[str], *,
                 keep_output: bool = True, timeline: dict | None = None, structured_field: str = "structured_outputs",
                 skip_special_tokens: bool = True, include_stop: bool = False):
        self.state, self.prompts, self.params, self.n = state, prompts, params[0], len(params)
        self.structured_field = structured_field
        self.keep_output = keep_output
        self.sequences = [ids for ids in prompts for _ in params]  # by choice index
        self.sequence_params = [one for _ in prompts for one in params]  # by choice index
        count = len(self.sequences)
        self.detok = [IncrementalDetokenizer(state.tokenizer, stop, skip_special_tokens=skip_special_tokens,
                                             include_stop=include_stop) for _ in range(count)]
        self.finish_reason: list[str | None] = [None] * count
        self.num_cached = [0] * count
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_ids: list[int] = []
        self.all_logprobs: list[list] = [[] for _ in range(count)]  # by choice, filled by :func:`collect`
        self.prompt_logprobs: list[list | None] = [None] * count  # by choice, from its first event
        self.stamps = None if timeline is None else [dict(timeline) for _ in range(count)]

    async def start(self) -> None:
        try:
            self.request_ids = await self.state.engine.submit(self.sequences, self.sequence_params, self.queue)
        except QueueFullError as e:
            raise APIError(503, str(e), type="service_unavailable", code="queue_full") from None
        except EngineClosedError as e:
            raise APIError(503, str(e), type="service_unavailable") from None
        except RequestRejected as e:
            if e.index is None:  # more sequences than the queue holds
                param = "n" if self.n > 1 else "prompt"
            else:
                param = "prompt" if len(self.prompts) == 1 else f"prompt[{e.index // self.n}]"
            message = str(e)
            if message.startswith("structured_outputs"):  # the engine's grammar refused it: name the request's field
                param = self.structured_field
                message = re.sub(r"^structured_outputs(\.\w+)?", param, message)
            elif "max_tokens" in message:
                param = "max_tokens"
            raise bad_request(message, param=param) from None

    async def deltas(self) -> AsyncIterator[Delta]:
        left = len(self.sequences)
        try:
            while left:
                event = await self.queue.get()
                if event[0] != "tokens":
                    if event[0] == "error":
                        raise APIError(500, event[2], type="internal_server_error")
                    self.stamps[event[1]].update(event[2], handler=time.perf_counter())  # "timeline"
                    continue
                _, i, new_ids, reason, num_cached, new_logprobs, prompt_logprobs = event
                if self.finish_reason[i] is not None:
                    continue  # stopped by a stop string; the engine's abort is on its way
                if prompt_logprobs is not None:
                    self.prompt_logprobs[i] = prompt_logprobs
                if not self.keep_output:
                    new_ids, new_logprobs, reason = [], None, reason and "length"
                detok = self.detok[i]
                self.num_cached[i] = num_cached
                taken = detok.num_tokens
                # the engine stops on ids only: its "stop" ends on one
                text = detok.push(new_ids, ends_on_stop_id=reason == "stop" and not detok.include_stop)
                taken = detok.num_tokens - taken  # fewer than new_ids when a stop string matched
                logprobs = None if new_logprobs is None else list(zip(new_ids[:taken], new_logprobs[:taken]))
                if detok.stopped:
                    if reason is None:
                        self.state.engine.abort([self.request_ids[i]], reason="stop")
                    reason = "stop"
                if reason is not None:
                    text += detok.finish()
                    if detok.stopped:  # the rest of the text, released at the end, held a match
                        reason = "stop"
                    self.finish_reason[i] = reason
                    left -= 1
                if taken or reason is not None:  # one chunk per step with tokens: load generators time them
                    yield Delta(i, text, reason, logprobs)
                    if self.stamps is not None and taken:
                        self.stamps[i].setdefault("sent", time.perf_counter())
        finally:
            self.abort_unfinished()
            if self.stamps is not None:
                self._write_timeline()

    def prompt_entries(self, index: int) -> list[tuple[int, dict[int, float] | None]]:
        """Choice ``index``'s prompt tokens with their logprobs (``SamplingParams.prompt_logprobs``):
        None for the first token, and for every one if the engine sent none."""
        ids = self.sequences[index]
        entries = self.prompt_logprobs[index] or self.prompt_logprobs[index - index % self.n]  # or its prompt's first choice's
        return list(zip(ids, entries or [None] * len(ids)))

    def _write_timeline(self) -> None:
        now = time.perf_counter()
        records = []
        for i, stamps in enumerate(self.stamps):
            stamps.update(index=i, request_id=self.request_ids[i] if self.request_ids else None,
                          prompt_tokens=len(self.sequences[i]), cached_tokens=self.num_cached[i],
                          output_tokens=self.detok[i].num_tokens, finish_reason=self.finish_reason[i], finished=now)
            records.append(stamps)
        self.stamps = None
        self.state.timeline.write(records)

    def abort_unfinished(self) -> None:
        """Abort the choices that have not finished (nothing when all have; safe to repeat)."""
        running = [rid for rid, reason in zip(self.request_ids, self.finish_reason) if reason is None]
        if running:
            self.state.engine.abort(running)

    def usage(self) -> p.UsageInfo:
        """Each prompt's tokens once (its cached ones as its first choice found them), every choice's
        generated tokens."""
        prompt = sum(len(ids) for ids in self.prompts)
        completion = sum(d.num_tokens for d in self.detok)
        cached = sum(self.num_cached[:: self.n])
        return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))


async def until_disconnect(receive) -> None:
    """Returns when the client closed the connection (the body was read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def collect(gen: Generation, receive) -> list[str]:
    """Run ``gen`` to the end; its texts by choice. Raises :class:`ClientGone` (after aborting)
    when the client leaves first."""
    texts = [""] * len(gen.sequences)
    gen.all_logprobs = [[] for _ in gen.sequences]

    async def run():
        async for d in gen.deltas():
            texts[d.index] += d.text
            gen.all_logprobs[d.index] += d.logprobs or []

    task = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(until_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
    if task not in done:
        raise ClientGone()
    task.result()
    return texts

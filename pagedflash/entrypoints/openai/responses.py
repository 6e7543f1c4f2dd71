"""The OpenAI response bodies and stream chunks of a :class:`~.serving.Generation`: completions'
and chat's, each whole or as server-sent events, with their logprobs formats."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from pagedflash.entrypoints.openai import protocol as p
from pagedflash.entrypoints.openai import tools
from pagedflash.entrypoints.openai.serving import APIError, Generation, collect
from pagedflash.entrypoints.openai.tokenizer import TextTokenizer


def _sse(payload) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ------------------------------------------------------------------ logprobs
def completion_logprobs(tokenizer: TextTokenizer, entries, offset: int = 0) -> p.CompletionLogprobs:
    """Completions' format: each token's text, logprob and text offset (from ``offset``), and its
    position's logprobs by token text (the sampled token and the top k; where several tokens have
    one text, as bytes of a longer character do, the likeliest's); null for a token whose table is
    None (a prompt's first)."""
    out = p.CompletionLogprobs()
    for token, table in entries:
        text = tokenizer.token_text(token)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if table is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(table[token])
        top: dict[str, float] = {}
        for t, lp in sorted(table.items(), key=lambda x: -x[1]):  # tokens of equal text: the likeliest's
            top.setdefault(tokenizer.token_text(t), lp)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(tokenizer: TextTokenizer, entries, k: int) -> p.ChatLogprobs:
    """Chat's format: each token with its logprob and bytes, and the ``k`` most likely at its position.
    ``bytes``: the token's own (:meth:`.TextTokenizer.token_bytes`; a token holding part of a multi-byte
    character has that part's bytes, its ``token`` text U+FFFD), so the ``bytes`` of a reply's tokens
    join into its content's UTF-8, but for the tokens its text leaves out (the ending stop id, skipped
    special tokens)."""
    def one(cls, token, logprob, **extra):
        return cls(token=tokenizer.token_text(token), logprob=logprob, bytes=list(tokenizer.token_bytes(token)),
                   **extra)

    return p.ChatLogprobs(content=[
        one(p.ChatLogprobToken, token, table[token],
            top_logprobs=[one(p.TopLogprob, t, lp) for t, lp in sorted(table.items(), key=lambda x: -x[1])[:k]])
        for token, table in entries])


# ------------------------------------------------------------------ completions
async def completion_response(gen: Generation, receive, model: str, *,
                              echo: list[str] | None = None) -> p.CompletionResponse:
    """echo: each prompt's text, put before its choices' (with logprobs, its tokens' entries too)."""
    texts = await collect(gen, receive)
    tok, asked = gen.state.tokenizer, gen.params.logprobs is not None
    choices = []
    for i, (text, reason) in enumerate(zip(texts, gen.finish_reason)):
        entries = gen.all_logprobs[i]
        if echo is not None:
            text = echo[i // gen.n] + text
            entries = gen.prompt_entries(i) + entries if asked else entries
        choices.append(p.CompletionChoice(index=i, text=text, finish_reason=reason,
                                          logprobs=completion_logprobs(tok, entries) if asked else None))
    return p.CompletionResponse(id=new_id("cmpl"), model=model, choices=choices, usage=gen.usage())


async def completion_stream(gen: Generation, model: str, include_usage: bool, *,
                            echo: list[str] | None = None) -> AsyncIterator[str]:
    """echo: each prompt's text, put in its choices' first chunks (with logprobs, its tokens' entries too)."""
    rid, created = new_id("cmpl"), int(time.time())

    def chunk(choices, usage=None):  # built without validation: every value is the server's own
        return _sse(p.CompletionResponse.model_construct(id=rid, created=created, model=model, choices=choices,
                                                         usage=usage))

    tok, asked = gen.state.tokenizer, gen.params.logprobs is not None
    offsets = [0] * len(gen.sequences)
    echoed = [echo is None] * len(gen.sequences)
    try:
        async for d in gen.deltas():
            text, entries = d.text, d.logprobs or []
            if not echoed[d.index]:
                echoed[d.index] = True
                text = echo[d.index // gen.n] + text
                entries = gen.prompt_entries(d.index) + entries if asked else entries
            logprobs = None
            if asked:
                logprobs = completion_logprobs(tok, entries, offsets[d.index])
                offsets[d.index] += sum(len(t) for t in logprobs.tokens)
            yield chunk([p.CompletionChoice.model_construct(index=d.index, text=text, finish_reason=d.finish_reason,
                                                            logprobs=logprobs)])
        if include_usage:
            yield chunk([], gen.usage())
    except APIError as e:
        yield _sse(e.body())
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------ chat
async def chat_response(gen: Generation, receive, model: str, *, plan: tools.ToolPlan) -> p.ChatCompletionResponse:
    texts = await collect(gen, receive)
    tok, k = gen.state.tokenizer, gen.params.logprobs
    choices = []
    for i, (text, reason) in enumerate(zip(texts, gen.finish_reason)):
        content, calls, reason = tools.finish(plan, text, reason)
        choices.append(p.ChatChoice(index=i, message=p.ChatResponseMessage(content=content, tool_calls=calls),
                                    finish_reason=reason,
                                    logprobs=None if k is None else chat_logprobs(tok, gen.all_logprobs[i], k)))
    return p.ChatCompletionResponse(id=new_id("chatcmpl"), model=model, usage=gen.usage(), choices=choices)


async def chat_stream(gen: Generation, model: str, include_usage: bool, plan: tools.ToolPlan) -> AsyncIterator[str]:
    """A first chunk with the role for each choice, then the choices' deltas as they come (under a
    tool plan: :mod:`.tools`)."""
    rid, created = new_id("chatcmpl"), int(time.time())

    def chunk(choices, usage=None):  # built without validation: every value is the server's own
        return _sse(p.ChatCompletionChunk.model_construct(id=rid, created=created, model=model, choices=choices,
                                                          usage=usage))

    def call_delta(i: int, call: p.ToolCall) -> p.DeltaToolCall:
        return p.DeltaToolCall(index=i, id=call.id, type="function",
                               function=p.DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))

    held = {i: tools.ToolStream(plan) for i in range(gen.n)} if plan.mode in ("required", "auto") else None
    named_started = set()  # choices whose named call's first delta went
    try:
        for i in range(gen.n):
            yield chunk([p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))])
        k = gen.params.logprobs
        async for d in gen.deltas():
            logprobs = None if k is None else chat_logprobs(gen.state.tokenizer, d.logprobs or [], k)
            reason = d.finish_reason
            if plan.mode == "named":
                if d.index in named_started:
                    calls = [p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(arguments=d.text))]
                else:
                    named_started.add(d.index)
                    calls = [call_delta(0, tools.tool_call(plan.name, d.text, plan.call_id))]
                delta = p.DeltaMessage.model_construct(tool_calls=calls)
            elif held is not None:
                content, calls = held[d.index].push(d.text), None
                if reason is not None:  # the calls, then the finish reason in a chunk of its own (as OpenAI)
                    rest, found, reason = held[d.index].finish(reason)
                    content += rest
                    calls = [call_delta(j, c) for j, c in enumerate(found)] or None
                    yield chunk([p.ChatChunkChoice.model_construct(
                        index=d.index, delta=p.DeltaMessage.model_construct(content=content or None, tool_calls=calls),
                        logprobs=logprobs)])
                    delta, logprobs = p.DeltaMessage.model_construct(), None
                else:
                    delta = p.DeltaMessage.model_construct(content=content)
            else:
                delta = p.DeltaMessage.model_construct(content=d.text)
            yield chunk([p.ChatChunkChoice.model_construct(index=d.index, delta=delta, logprobs=logprobs,
                                                           finish_reason=reason)])
        if include_usage:
            yield chunk([], gen.usage())
    except APIError as e:
        yield _sse(e.body())
    yield "data: [DONE]\n\n"

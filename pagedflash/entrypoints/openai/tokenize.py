"""vLLM's tokenizer endpoints: ``POST /tokenize`` (token ids of a prompt, or of a chat as
``/v1/chat/completions`` renders it) and ``POST /detokenize`` (text of token ids).

``/tokenize`` takes a completion-style body, ``prompt`` (``add_special_tokens`` default true: the BOS
that completions add), or a chat-style one, ``messages`` (``add_generation_prompt`` default true;
``add_special_tokens`` default false, as the chat template writes the special tokens). It returns
``count``, ``max_model_len``, ``tokens`` and, with ``return_token_strs``, each token's text. A prompt or
a chat is counted whatever its length (messages rendered by :func:`.serving.chat_prompt`, with
``tools`` when given). ``continue_final_message`` and ``add_special_tokens: true`` with
messages are refused: the template path renders whole messages and adds nothing to the template's text.

``/detokenize`` takes ``tokens`` and returns their text with the special tokens written out, as vLLM's
does (so a chat's tokens give back the rendered template). A ``model`` other than the served one gets
the generation endpoints' refusal.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from pagedflash.entrypoints.openai import protocol as p
from pagedflash.entrypoints.openai import serving
from pagedflash.entrypoints.openai.serving import ServerState, bad_request


class TokenizeRequest(BaseModel):
    """vLLM's two bodies in one: ``prompt`` or ``messages``, exactly one of them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = None
    tools: list[p.Tool] | None = None  # messages only: rendered by the chat template
    add_special_tokens: StrictBool | None = None  # None: true with a prompt, false with messages
    add_generation_prompt: StrictBool = True  # messages only
    continue_final_message: StrictBool = False  # messages only; true is refused
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(state: ServerState, body: TokenizeRequest) -> TokenizeResponse:
    serving.check_model(state, body.model)
    if body.prompt is not None and body.messages is not None:
        raise bad_request("give prompt or messages, not both", param="prompt")
    if body.prompt is None and body.messages is None:
        raise bad_request("prompt or messages is required (a text, or a chat to render with the chat template)",
                          param="prompt", code="missing")
    ids = prompt_ids(state, body) if body.messages is None else chat_ids(state, body)
    strs = [state.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


def prompt_ids(state: ServerState, body: TokenizeRequest) -> list[int]:
    special = True if body.add_special_tokens is None else body.add_special_tokens
    return state.tokenizer.encode(body.prompt, add_special_tokens=special)


def chat_ids(state: ServerState, body: TokenizeRequest) -> list[int]:
    """The ids ``/v1/chat/completions`` feeds the engine for these messages."""
    if body.continue_final_message:
        raise bad_request("continue_final_message is not supported (the chat template renders whole messages)",
                          param="continue_final_message", code="unsupported")
    if body.add_special_tokens:
        raise bad_request("add_special_tokens: true is not supported with messages (the chat template writes the "
                          "special tokens; nothing is added to its text)", param="add_special_tokens",
                          code="unsupported")
    chat = p.ChatCompletionRequest(model=body.model, messages=body.messages, tools=body.tools,
                                   add_generation_prompt=body.add_generation_prompt)
    return serving.chat_prompt(state, chat, check=False)


def detokenize(state: ServerState, body: DetokenizeRequest) -> DetokenizeResponse:
    serving.check_model(state, body.model)
    bad = next((t for t in body.tokens if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {state.vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens, skip_special_tokens=False))

"""Request and response bodies of the OpenAI API, as typed models (pydantic v2).

Requests: the fields OpenAI defines plus vLLM's extensions that load generators send (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``structured_outputs``).
Unknown fields are ignored, as OpenAI and vLLM do; fields the server cannot honour (``suffix``,
``best_of``) are listed by :func:`unsupported_field`, which the handlers turn into a 400 naming the
field. Chat's ``tools`` and ``tool_choice``: :mod:`.tools`. ``response_format`` (``json_object``,
``json_schema``) and ``structured_outputs`` (vLLM's: a JSON schema, a regex, choices or a grammar)
constrain the output (the engine's :class:`~pagedflash.engine.structured.StructuredOutputsParams`). Logprobs (completions' ``logprobs: k``, chat's ``logprobs: true`` + ``top_logprobs: k``,
k <= 20) come from the engine, computed before the bias, penalties, temperature and filtering as
vLLM's are; with completions' ``echo`` the prompt's tokens come first, the first one's entries null.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_serializer


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema (OpenAI's ``strict`` accepted; the output always
    matches the schema)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` request field: one of its constraints. vLLM's other keys are
    accepted when null or false (clients send its whole dataclass); set, they are a 400 naming them
    (:meth:`unsupported`); unknown keys are a 400 too."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: StrictBool = False
    disable_fallback: StrictBool = False  # there is one backend: nothing to fall back from
    disable_additional_properties: StrictBool = False
    whitespace_pattern: str | None = None
    structural_tag: Any = None

    def unsupported(self) -> str | None:
        """The first of vLLM's keys set that the engine does not do, or None."""
        return next((k for k in ("disable_additional_properties", "whitespace_pattern", "structural_tag")
                     if getattr(self, k) not in (None, False)), None)


class _GenerationRequest(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: StrictInt | None = None  # 0 or -1: off
    min_p: float | None = None  # None: 0 (off)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True  # vLLM's: special tokens (BOS, markers) left out of the text
    include_stop_str_in_output: StrictBool = False  # vLLM's: the matched stop string or ending stop id written
    n: StrictInt | None = None  # choices per prompt; None: 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None  # None: 0 (off)
    frequency_penalty: float | None = None  # None: 0 (off)
    repetition_penalty: float | None = None  # None: 1 (off)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    user: str | None = None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's earlier calls


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: any object
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: StrictBool = True  # accepted; "required" may return several calls either way
    add_generation_prompt: StrictBool = True  # vLLM's extension


def unsupported_field(request: _GenerationRequest) -> tuple[str, str] | None:
    """(field, why) for the first field asking for something the server does not do, else None."""
    checks = []
    if isinstance(request, CompletionRequest):
        checks += [
            ("suffix", bool(request.suffix), "suffix is not supported"),
            ("best_of", request.best_of not in (None, 1), "best_of is not supported"),
        ]
    else:
        checks += [
            ("top_logprobs", request.top_logprobs is not None and not request.logprobs,
             "top_logprobs needs logprobs: true"),
        ]
    if request.stream_options is not None and not request.stream:
        checks.append(("stream_options", True, "stream_options is only allowed when stream is true"))
    return next(((name, why) for name, bad, why in checks if bad), None)


# ------------------------------------------------------------------ responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Per token of the text (with ``echo``, the prompt's first): its text, log-probability, text
    offset, and the top ones by text; the first prompt token's log-probability and top ones are null."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken]


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A call's first delta has its id, type and name; later ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    """Only the fields it carries are written: the role in the first chunk, then content or tool
    calls, then none."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedflash"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

"""Tool calling in chat completions, as vLLM's server does it.

``tools`` (OpenAI's function tools) go to the chat template as transformers passes them (the list of
``{"type": "function", "function": {...}}``), and assistant messages' ``tool_calls`` reach it with
their ``arguments`` as dicts (what tool-use templates expect). ``tool_choice``:

- ``"none"``: the tools are rendered, the output is text;
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained
  to that function's ``parameters`` schema and returned as one tool call (finish reason ``"stop"``);
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects,
  one of the tools each, and returned as that many tool calls (``"tool_calls"``);
- ``"auto"`` (the default with tools): the model decides; its text is parsed for calls by the
  server's ``--tool-call-parser`` (:data:`PARSERS`: ``hermes`` for Qwen 2.5/3 and Hermes models,
  ``llama3_json`` for Llama 3.1-3.3, ``mistral`` for Mistral's), ``"tool_calls"`` when it made one;
  its text keeps special tokens (``skip_special_tokens`` false, as vLLM's parsers ask: the markers
  ``<tool_call>``, ``<|python_tag|>`` and ``[TOOL_CALLS]`` are special tokens in some vocabularies).

``parallel_tool_calls: false`` keeps one call (``"required"``: an array of one). A reply cut short by
``max_tokens`` keeps ``"length"``. Streamed, a named call's arguments stream as they come;
``"required"`` and ``"auto"`` stream the text before the first call, send the calls whole once the
output has ended, then the finish reason in a chunk of its own.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pagedflash.engine.structured import StructuredOutputsParams
from pagedflash.entrypoints.openai import protocol as p


class ToolError(ValueError):
    """A tool field the server cannot honour: a 400 naming ``param``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    """9 letters and digits: what Mistral's chat templates require of an earlier call's id."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def nine_char_id(call_id: str) -> str:
    """A client's tool-call id in the form Mistral's chat templates require (9 letters and digits):
    the id itself when it has that form, else 9 base-62 digits of its SHA-256, so that an id the client
    made up (OpenAI's ``call_...``, our own ``chatcmpl-tool-...`` from a server without the mistral
    parser) names the same call in the assistant message and in the tool message that answers it."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    value = int.from_bytes(hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    digits = string.digits + string.ascii_letters
    return "".join(digits[value // 62**i % 62] for i in range(9))


@dataclass
class ToolPlan:
    """What a chat request's ``tool_choice`` asks of the engine and of its response."""

    mode: str  # "none", "named", "required", "auto"
    name: str | None = None  # the named function's
    parser: str | None = None  # "auto": the server's --tool-call-parser
    parallel: bool = True  # several calls allowed
    call_id: Callable[[], str] = new_call_id  # the server's parser's id form, whatever the mode

    def constraint(self, tools: list[p.Tool]) -> StructuredOutputsParams | None:
        if self.mode == "named":
            tool = next(t for t in tools if t.function.name == self.name)
            return StructuredOutputsParams(json=tool.function.parameters or {"type": "object"})
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(tools, self.parallel))
        return None


def required_schema(tools: list[p.Tool], parallel: bool = True) -> dict:
    """A non-empty JSON array of calls (of one without ``parallel``), each ``{"name": <a tool's>,
    "parameters": <its schema>}``."""
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "parameters": t.function.parameters or {"type": "object"}},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}


def plan(request: p.ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """The request's tool plan; :class:`ToolError` for what cannot be honoured."""
    tools, choice = request.tools or [], request.tool_choice
    _check_tools(tools)
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, p.NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise ToolError(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                            f"({sorted(t.function.name for t in tools)})", "tool_choice")
        found = ToolPlan("named", name=choice.function.name)
    elif choice in ("required", "auto") and not tools:
        raise ToolError(f"tool_choice {choice!r} needs tools", "tool_choice")
    elif choice == "auto" and parser is None:
        raise ToolError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                        '--tool-call-parser (or use "required", a named function, or "none")', "tool_choice")
    else:
        found = ToolPlan(choice, parser=parser if choice == "auto" else None)
    if found.mode in ("named", "required") and (request.response_format is not None
                                                or request.structured_outputs is not None):
        raise ToolError(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} constrains "
                        "the output already: give it or response_format / structured_outputs, not both", "tool_choice")
    found.parallel = request.parallel_tool_calls
    if parser is not None:
        found.call_id = PARSERS[parser].call_id
    return found


def _check_tools(tools: list[p.Tool]) -> None:
    seen = set()
    for i, t in enumerate(tools):
        if t.function.name in seen:
            raise ToolError(f"tools[{i}].function.name {t.function.name!r} is given twice", f"tools[{i}].function.name")
        seen.add(t.function.name)
        schema = t.function.parameters
        if schema is not None and schema.get("type", "object") != "object":
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema of an object, got type "
                            f"{schema.get('type')!r}", f"tools[{i}].function.parameters")


def template_messages(messages: list[dict], *, nine_char_ids: bool = False) -> list[dict]:
    """``messages`` with assistant ``tool_calls``' ``arguments`` as dicts (JSON text in the API; an
    empty text is ``{}``); :class:`ToolError` naming the one that is not a JSON object.
    ``nine_char_ids``: every call id (the assistant's ``tool_calls[].id``, a tool message's
    ``tool_call_id``) through :func:`nine_char_id`, as a Mistral template requires (vLLM fits them too)."""
    out = []
    for i, m in enumerate(messages):
        if nine_char_ids and isinstance(m.get("tool_call_id"), str):
            m = {**m, "tool_call_id": nine_char_id(m["tool_call_id"])}
        if m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                text = call["function"]["arguments"]
                try:
                    arguments = json.loads(text) if text.strip() else {}
                except (ValueError, RecursionError) as e:
                    arguments = e
                if not isinstance(arguments, dict):
                    field = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise ToolError(f"{field} must be the JSON text of an object, got {text[:80]!r}", field)
                call = {**call, "function": {**call["function"], "arguments": arguments}}
                if nine_char_ids and isinstance(call.get("id"), str):
                    call["id"] = nine_char_id(call["id"])
                calls.append(call)
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


# ------------------------------------------------------------------ the model's output
def tool_call(name: str, arguments: str, call_id: Callable[[], str] = new_call_id) -> p.ToolCall:
    """A call of ``name`` with ``arguments`` (JSON text) under a new id."""
    return p.ToolCall(id=call_id(), function=p.FunctionCall(name=name, arguments=arguments))


def parse_required(text: str, call_id: Callable[[], str] = new_call_id) -> list[p.ToolCall] | None:
    """The calls of a ``"required"`` output (a JSON array), or None where it is incomplete (or its
    arguments would not make valid JSON text again)."""
    values = _loads(text)
    if not isinstance(values, list):
        return None
    calls = [_call(c, ("parameters",), call_id) for c in values]
    return None if not calls or None in calls else calls


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)  # the last may end unclosed
HERMES_START = "<tool_call>"


def parse_hermes(text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(the text before the first call, or None when empty; the calls) of a hermes-format output. If
    a block is not the JSON of ``{"name": <a string>, "arguments": <an object, or its JSON text>}``,
    the whole output is text."""
    calls = []
    for block in _HERMES.finditer(text):
        call = _call(_loads(block.group(1) if block.group(1) is not None else block.group(2)))
        if call is None:
            return text or None, []
        calls.append(call)
    if not calls:
        return text or None, []
    return text[: text.index(HERMES_START)] or None, calls


LLAMA3_START = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;?\s*")


def parse_llama3_json(text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(None, the calls) of an output that is only calls in Llama 3.1-3.3's JSON format: after optional
    whitespace and ``<|python_tag|>``, one or more ``{"name": <a string>, "arguments"`` (or
    ``"parameters"``) ``: <an object, or its JSON text>}`` objects, separated by ``;`` and whitespace.
    Anything else (text first, a call that is not such JSON, text after the calls) is all text."""
    body = text.lstrip()
    body = body[len(LLAMA3_START) :].lstrip() if body.startswith(LLAMA3_START) else body
    calls, at = [], 0
    while at < len(body):
        decoded = _raw_json(body, at)
        call = None if decoded is None else _call(decoded[0], ("arguments", "parameters"))
        if call is None:
            return text or None, []
        calls.append(call)
        at = _SEPARATOR.match(body, decoded[1]).end()
    return (None, calls) if calls else (text or None, [])


def _llama3_sendable(text: str) -> int:
    body = text.lstrip()
    if not body or body.startswith("{") or body.startswith(LLAMA3_START) or LLAMA3_START.startswith(body):
        return 0  # may be a call: held back whole
    return len(text)


MISTRAL_START = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"
_SPACE = re.compile(r"\s*")


def parse_mistral(text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(the text before the first call, or None when empty; the calls) of a Mistral-format output:
    ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects (Mistral 7B v0.3, Nemo), or
    ``[TOOL_CALLS]<name>[ARGS]<JSON object>`` once per call (the v11 tokenizers'; a ``[CALL_ID]<id>``
    after the name is dropped). Calls get the 9-character alphanumeric ids Mistral's chat templates
    require of earlier calls. If what follows the marker is neither, the whole output is text."""
    start = text.find(MISTRAL_START)
    if start < 0:
        return text or None, []
    calls, at = [], start
    while at < len(text):
        if not text.startswith(MISTRAL_START, at):
            return text, []
        at = _SPACE.match(text, at + len(MISTRAL_START)).end()
        if text.startswith(("[", "{"), at):  # a JSON array (or object) of calls
            decoded = _raw_json(text, at)
            values = [] if decoded is None else decoded[0] if isinstance(decoded[0], list) else [decoded[0]]
        else:  # name[ARGS]{...}
            args = text.find(MISTRAL_ARGS, at)
            decoded = None if args < 0 else _raw_json(text, _SPACE.match(text, args + len(MISTRAL_ARGS)).end())
            values = [] if decoded is None else \
                [{"name": text[at:args].split(MISTRAL_CALL_ID)[0].strip(), "arguments": decoded[0]}]
        found = [_call(v, call_id=mistral_call_id) for v in values]
        if not found or None in found:
            return text, []
        calls += found
        at = _SPACE.match(text, decoded[1]).end()
    return text[:start] or None, calls


_DECODER = json.JSONDecoder()
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # what a request's tool names may be


def _loads(text: str):
    """The JSON value of ``text``, or None (also for text that is not JSON, or past Python's digit or
    nesting limits: no caller takes a null)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _raw_json(text: str, at: int) -> tuple[object, int] | None:
    """(the JSON value starting at ``at``, where it ends), or None as :func:`_loads`."""
    try:
        return _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        return None


def _call(value, keys: tuple[str, ...] = ("arguments",), call_id: Callable[[], str] = new_call_id) -> p.ToolCall | None:
    """The call of ``{"name": <a tool name>, <one of keys>: <an object, or its JSON text>}``, else None
    (also for arguments that do not make valid JSON text again: NaN, a lone surrogate)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not _NAME.fullmatch(value["name"]):
        return None
    arguments = next((value[k] for k in keys if k in value), {})
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        text.encode()
    except (ValueError, RecursionError):
        return None
    return tool_call(value["name"], text, call_id)


def _marker_sendable(marker: str):
    def sendable(text: str) -> int:
        start = text.find(marker)
        return start if start >= 0 else _safe_end(text, marker)
    return sendable


@dataclass(frozen=True)
class Parser:
    """A tool-call format: ``parse`` gives a finished output's (content, calls); ``sendable`` how much
    of an unfinished output is content whatever follows (what a stream may send)."""

    parse: Callable[[str], tuple[str | None, list[p.ToolCall]]]
    sendable: Callable[[str], int]
    call_id: Callable[[], str] = new_call_id  # also the named and "required" calls' ids


PARSERS = {
    "hermes": Parser(parse_hermes, _marker_sendable(HERMES_START)),  # Qwen 2.5 / 3, Hermes
    "llama3_json": Parser(parse_llama3_json, _llama3_sendable),  # Llama 3.1 / 3.2 / 3.3
    "mistral": Parser(parse_mistral, _marker_sendable(MISTRAL_START), mistral_call_id),  # Mistral 7B v0.3, Nemo, Small
}


def finish(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[p.ToolCall], str | None]:
    """A finished choice under ``plan``: (its content, its calls, its finish reason). ``"required"``
    and ``"auto"`` give ``"tool_calls"`` when the output made calls and ended by itself; an output
    that made none is text."""
    if plan.mode == "named":
        return None, [tool_call(plan.name, text, plan.call_id)], finish_reason
    if plan.mode == "required":
        content, calls = None, parse_required(text, plan.call_id)
        if calls is None:
            return text, [], finish_reason
    elif plan.mode == "auto":
        content, calls = PARSERS[plan.parser].parse(text)
        if not calls:
            return text, [], finish_reason
    else:
        return text, [], finish_reason
    calls = calls if plan.parallel else calls[:1]
    return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolStream:
    """One streamed choice's text under a ``"required"`` or ``"auto"`` plan: :meth:`push` gives the
    content that may be sent now (``"auto"``: the text before a call's start, text that may begin one
    held back; ``"required"``: none, its output being the calls' JSON), :meth:`finish` the rest."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text, self.sent = plan, "", 0

    def push(self, delta: str) -> str:
        self.text += delta
        if self.plan.mode != "auto":
            return ""
        end = PARSERS[self.plan.parser].sendable(self.text)
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def finish(self, finish_reason: str | None) -> tuple[str, list[p.ToolCall], str | None]:
        """(the content not yet sent, the calls, the finish reason)."""
        content, calls, reason = finish(self.plan, self.text, finish_reason)
        return "" if content is None else content[self.sent :], calls, reason


def _safe_end(text: str, marker: str) -> int:
    """Where ``text`` stops being sendable: before a tail that is a prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)

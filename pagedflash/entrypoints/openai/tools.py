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
  server's ``--tool-call-parser`` (:data:`PARSERS`; ``hermes``: ``<tool_call>{"name", "arguments"}
  </tool_call>`` blocks, the format of Qwen 2.5/3 and Hermes models), ``"tool_calls"`` when it made one.

Streamed, a named call's arguments stream as they come; ``"required"`` and ``"auto"`` stream the text
before the first call and send the calls whole in the last delta, once their JSON is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pagedflash.engine.structured import StructuredOutputsParams
from pagedflash.entrypoints.openai import protocol as p


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolPlan:
    """What a chat request's ``tool_choice`` asks of the engine and of its response."""

    mode: str  # "none", "named", "required", "auto"
    name: str | None = None  # the named function's
    parser: str | None = None  # "auto": the server's --tool-call-parser

    def constraint(self, tools: list[p.Tool]) -> StructuredOutputsParams | None:
        if self.mode == "named":
            tool = next(t for t in tools if t.function.name == self.name)
            return StructuredOutputsParams(json=tool.function.parameters or {"type": "object"})
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(tools))
        return None


def required_schema(tools: list[p.Tool]) -> dict:
    """A non-empty JSON array of calls, each ``{"name": <a tool's>, "parameters": <its schema>}``."""
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "parameters": t.function.parameters or {"type": "object"}},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


class ToolChoiceError(ValueError):
    """A ``tool_choice`` the server cannot honour (a 400 naming ``tool_choice``)."""


def plan(request: p.ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """The request's tool plan; :class:`ToolChoiceError` for what cannot be honoured."""
    tools, choice = request.tools or [], request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, p.NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise ToolChoiceError(f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                                  f"({sorted(t.function.name for t in tools)})")
        found = ToolPlan("named", name=choice.function.name)
    elif choice in ("required", "auto") and not tools:
        raise ToolChoiceError(f"tool_choice {choice!r} needs tools")
    elif choice == "auto" and parser is None:
        raise ToolChoiceError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser (or use "required", a named function, or "none")')
    else:
        found = ToolPlan(choice, parser=parser if choice == "auto" else None)
    if found.mode in ("named", "required") and (request.response_format is not None
                                                or request.structured_outputs is not None):
        raise ToolChoiceError(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} constrains "
                              "the output already: give it or response_format / structured_outputs, not both")
    return found


def template_messages(messages: list[dict]) -> list[dict]:
    """``messages`` with assistant ``tool_calls``' ``arguments`` as dicts (JSON text in the API)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_with_dict_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_dict_arguments(call: dict) -> dict:
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except json.JSONDecodeError:
            pass
    return call


# ------------------------------------------------------------------ the model's output
def tool_call(name: str, arguments) -> p.ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=name, arguments=text))


def parse_required(text: str) -> list[p.ToolCall] | None:
    """The calls of a ``"required"`` output (a JSON array), or None where it is incomplete."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [tool_call(c["name"], c["parameters"]) for c in calls]


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
HERMES_START = "<tool_call>"


def parse_hermes(text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(the text before the first call, or None when empty; the calls) of a hermes-format output. A
    block whose JSON does not parse as ``{"name", "arguments"}`` is left in the text, as is an
    unclosed one."""
    calls = []
    for block in _HERMES.finditer(text):
        try:
            value = json.loads(block.group(1))
            calls.append(tool_call(value["name"], value.get("arguments", {})))
        except (json.JSONDecodeError, KeyError, TypeError):
            return text or None, []
    if not calls:
        return text or None, []
    return text[: text.index(HERMES_START)] or None, calls


PARSERS = {"hermes": parse_hermes}


class ToolStream:
    """One streamed choice's text under a ``"required"`` or ``"auto"`` plan: :meth:`push` gives what
    may be sent as content now (auto: the text before a call's start; required: nothing), and
    :meth:`finish` what is left, the calls and the finish reason."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.text, self.sent = plan, "", 0

    def push(self, delta: str) -> str:
        self.text += delta
        if self.plan.mode != "auto":
            return ""
        start = self.text.find(HERMES_START)  # text that may begin a call is held back
        end = start if start >= 0 else _safe_end(self.text, HERMES_START)
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def finish(self, finish_reason: str | None) -> tuple[str, list[p.ToolCall] | None, str | None]:
        """(content not yet sent, the calls or None, the finish reason to send)."""
        calls = final_calls(self.plan, self.text)
        if calls is None:
            return self.text[self.sent :], None, finish_reason
        return "", calls, "tool_calls"


def _safe_end(text: str, marker: str) -> int:
    """Where ``text`` stops being sendable: before a tail that is a prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


def final_calls(plan: ToolPlan, text: str) -> list[p.ToolCall] | None:
    """The calls a finished output makes under ``plan`` (None: it is text)."""
    if plan.mode == "named":
        return [tool_call(plan.name, text)]
    if plan.mode == "required":
        return parse_required(text)
    if plan.mode == "auto":
        return PARSERS[plan.parser](text)[1] or None
    return None


def response_message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[p.ChatResponseMessage, str | None]:
    """A finished choice's message and finish reason."""
    if plan.mode == "auto":
        content, calls = PARSERS[plan.parser](text)
        if calls:
            return p.ChatResponseMessage(content=content, tool_calls=calls), "tool_calls"
        return p.ChatResponseMessage(content=text), finish_reason
    calls = final_calls(plan, text)
    if calls is None:  # "none", or a "required" array cut short by max_tokens
        return p.ChatResponseMessage(content=text), finish_reason
    reason = finish_reason if plan.mode == "named" else "tool_calls"
    return p.ChatResponseMessage(content=None, tool_calls=calls), reason

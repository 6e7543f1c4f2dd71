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
  </tool_call>`` blocks, the format of Qwen 2.5/3 and Hermes models), ``"tool_calls"`` when it made one;
  its text keeps special tokens (``skip_special_tokens`` false, as vLLM's parsers ask: some models'
  ``<tool_call>`` is one).

``parallel_tool_calls: false`` keeps one call (``"required"``: an array of one). A reply cut short by
``max_tokens`` keeps ``"length"``. Streamed, a named call's arguments stream as they come;
``"required"`` and ``"auto"`` stream the text before the first call, send the calls whole once the
output has ended, then the finish reason in a chunk of its own.
"""

from __future__ import annotations

import json
import re
import uuid
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


@dataclass
class ToolPlan:
    """What a chat request's ``tool_choice`` asks of the engine and of its response."""

    mode: str  # "none", "named", "required", "auto"
    name: str | None = None  # the named function's
    parser: str | None = None  # "auto": the server's --tool-call-parser
    parallel: bool = True  # several calls allowed

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


def template_messages(messages: list[dict]) -> list[dict]:
    """``messages`` with assistant ``tool_calls``' ``arguments`` as dicts (JSON text in the API; an
    empty text is ``{}``); :class:`ToolError` naming the one that is not a JSON object."""
    out = []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                text = call["function"]["arguments"]
                try:
                    arguments = json.loads(text) if text.strip() else {}
                except json.JSONDecodeError as e:
                    arguments = e
                if not isinstance(arguments, dict):
                    field = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise ToolError(f"{field} must be the JSON text of an object, got {text[:80]!r}", field)
                calls.append({**call, "function": {**call["function"], "arguments": arguments}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


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


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)  # the last may end unclosed
HERMES_START = "<tool_call>"


def parse_hermes(text: str) -> tuple[str | None, list[p.ToolCall]]:
    """(the text before the first call, or None when empty; the calls) of a hermes-format output. If
    a block is not the JSON of ``{"name": <a string>, "arguments": <an object, or its JSON text>}``,
    the whole output is text."""
    calls = []
    for block in _HERMES.finditer(text):
        call = _hermes_call(block.group(1) if block.group(1) is not None else block.group(2))
        if call is None:
            return text or None, []
        calls.append(call)
    if not calls:
        return text or None, []
    return text[: text.index(HERMES_START)] or None, calls


def _hermes_call(block: str) -> p.ToolCall | None:
    try:
        value = json.loads(block)
        if not isinstance(value, dict):
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    if not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
        return None
    return tool_call(value["name"], arguments)


PARSERS = {"hermes": parse_hermes}


def finish(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[p.ToolCall], str | None]:
    """A finished choice under ``plan``: (its content, its calls, its finish reason). ``"required"``
    and ``"auto"`` give ``"tool_calls"`` when the output made calls and ended by itself; an output
    that made none is text."""
    if plan.mode == "named":
        return None, [tool_call(plan.name, text)], finish_reason
    if plan.mode == "required":
        content, calls = None, parse_required(text)
        if calls is None:
            return text, [], finish_reason
    elif plan.mode == "auto":
        content, calls = PARSERS[plan.parser](text)
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
        start = self.text.find(HERMES_START)
        end = start if start >= 0 else _safe_end(self.text, HERMES_START)
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

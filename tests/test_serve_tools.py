"""Chat tool calling (:mod:`pagedflash.entrypoints.openai.tools`): the hermes, llama3_json and mistral
parsers and the streamed hold-back without a server; then over HTTP, with a tool-rendering template on
the tiny model: a named function (arguments constrained to its schema), ``"required"`` (a JSON array of
calls), ``"auto"`` (each parser; the tiny random model is made to write a call with ``structured_outputs``),
``"none"``, the template's view of tools and of earlier calls, streamed as not, and the 400s.
"""

import json
import random
import re

import pytest
from test_serve import MODEL, LiveServer, assert_400

from pagedflash.entrypoints.openai import protocol as p
from pagedflash.entrypoints.openai import serving, tools
from pagedflash.entrypoints.openai.tokenizer import TextTokenizer

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")

TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>'


# ------------------------------------------------------------------ without a server
def UNSERIALIZABLE(form):  # noqa: N802 -- calls no parser may raise on or return: the output is text
    return [form.format(x) for x in ('{"a": ' + "9" * 5000 + "}", "[" * 5000, '{"a": "\\ud800"}', '{"a": NaN}',
                                     '{"a": 1e999}')] + [form.format("{}").replace('"f"', name) for name in ('""', '"a b"')
                                                         if '"f"' in form]


def test_hermes_parser():
    content, calls = tools.parse_hermes("Let me look.\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("Oslo", "Paris"))
    assert content == "Let me look.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"}), ("get_weather", {"city": "Paris", "unit": "C"})]
    assert len({c.id for c in calls}) == 2
    assert tools.parse_hermes(HERMES_CALL)[0] is None
    for text in ("plain text", "<tool_call>{not json}</tool_call>", "<tool_call>{\"name\": 1", '<tool_call>{"x": 1}</tool_call>',
                 '<tool_call>{"name": 1, "arguments": {}}</tool_call>', '<tool_call>[1]</tool_call>',
                 '<tool_call>{"name": "f", "arguments": "hello"}</tool_call>', HERMES_CALL + "<tool_call>{bad",
                 *UNSERIALIZABLE('<tool_call>{{"name": "f", "arguments": {}}}</tool_call>')):
        assert tools.parse_hermes(text) == (text, []), text
    # the last block may end unclosed (the model stopped after its JSON); arguments may be JSON text
    content, calls = tools.parse_hermes('Hi <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert content == "Hi " and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("f", {"a": 1})]


def calls_of(parsed):
    return parsed[0], [(c.function.name, json.loads(c.function.arguments)) for c in parsed[1]]


def test_llama3_json_parser():
    call = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}'
    oslo = ("get_weather", {"city": "Oslo", "unit": "C"})
    for text in (call, "<|python_tag|>" + call, " \n" + call, call + "; " + call, call + "\n" + call,
                 "<|python_tag|>" + call + ";" + call.replace("parameters", "arguments")):
        content, found = calls_of(tools.parse_llama3_json(text))
        assert content is None and found == [oslo] * len(found) and len(found) == text.count("get_weather"), text
    _, found = calls_of(tools.parse_llama3_json('{"name": "f", "arguments": "{\\"a\\": 1}"}'))
    assert found == [("f", {"a": 1})]  # arguments may be JSON text
    for text in ("plain text", "Sure: " + call, call + " and some text", '{"name": 1, "parameters": {}}',
                 '{"x": 1}', "[1]", '{"name": "f", "parameters": "hello"}', call + "; {bad", "{", "", "<|python_tag|>",
                 ";" + call, *UNSERIALIZABLE("{{\"name\": \"f\", \"parameters\": {}}}")):
        assert tools.parse_llama3_json(text) == (text or None, []), text


def test_mistral_parser():
    oslo, paris = ("get_weather", {"city": "Oslo", "unit": "C"}), ("get_weather", {"city": "Paris", "unit": "C"})
    array = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}, ' \
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]'
    assert calls_of(tools.parse_mistral("Let me look. " + array)) == ("Let me look. ", [oslo, paris])
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "C"}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}'
    assert calls_of(tools.parse_mistral(v11)) == (None, [oslo, paris])
    ids = [c.id for c in tools.parse_mistral(array)[1]]
    assert len(set(ids)) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)  # what Mistral's templates require
    # markers inside the JSON are text; a [CALL_ID] after the name is dropped
    inner = '[TOOL_CALLS] [{"name": "f", "arguments": {"q": "[ARGS] [TOOL_CALLS]"}}]'
    assert calls_of(tools.parse_mistral(inner)) == (None, [("f", {"q": "[ARGS] [TOOL_CALLS]"})])
    assert calls_of(tools.parse_mistral('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}')) == (None, [("f", {"a": 1})])
    for text in ("plain text", "[TOOL_CALLS]", "[TOOL_CALLS] [{bad", '[TOOL_CALLS] [{"x": 1}]', "[TOOL_CALLS]f[ARGS]{",
                 '[TOOL_CALLS]f[ARGS]"text"', '[TOOL_CALLS] [{"name": "f", "arguments": {}}] trailing', "[TOOL_CALLS] []",
                 "[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS]" + "9" * 5000, *UNSERIALIZABLE("[TOOL_CALLS]f[ARGS]{}"),
                 *UNSERIALIZABLE('[TOOL_CALLS] [{{"name": "f", "arguments": {}}}]')):
        assert tools.parse_mistral(text) == (text, []), text


# a Mistral template's checks of earlier calls' ids (its own words), each id printed where it is used
MISTRAL_IDS_TEMPLATE = (
    "{% for message in messages %}{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% if not (call.id is string and call.id|length == 9) %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_CALLS]{{ call.id }}{% endfor %}{% elif message.role == 'tool' %}"
    "{% if message.tool_call_id is not defined or message.tool_call_id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_RESULTS]{{ message.tool_call_id }}:{{ message.content }}{% else %}{{ message.content }}{% endif %}"
    "{% endfor %}")
PRINTED_IDS_TEMPLATE = MISTRAL_IDS_TEMPLATE.replace("length == 9", "length > 0").replace("length != 9", "length < 1")


def earlier_call(call_id: str) -> list[dict]:
    return MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "12:00"}]


def test_nine_char_ids_fit_mistral_templates():
    """A client's own call ids (OpenAI's ``call_...``, ours without the mistral parser) reach a Mistral
    template as 9 letters and digits, the same in the call and in its answer; ids of that form stay;
    other templates and parsers see the ids as sent."""
    fitted = tools.nine_char_id("call_Xy7")
    assert len(fitted) == 9 and fitted.isalnum()
    assert fitted == tools.nine_char_id("call_Xy7") != tools.nine_char_id("call_Xy8")
    assert tools.nine_char_id("a1b2c3d4e") == "a1b2c3d4e" and tools.nine_char_id("a1b2c3d4-") != "a1b2c3d4-"

    def prompt(template, parser=None, call_id="call_Xy7"):
        tokenizer = TextTokenizer.tiny(chat_template=template)
        state = serving.ServerState(engine=None, tokenizer=tokenizer, model_name="m", max_model_len=1024,
                                    vocab_size=512, pool_tokens=1200, tool_parser=parser)
        request = p.ChatCompletionRequest.model_validate({"model": "m", "messages": earlier_call(call_id)})
        return tokenizer.decode(serving.chat_prompt(state, request, check=False), skip_special_tokens=False)

    assert TextTokenizer.tiny(chat_template=MISTRAL_IDS_TEMPLATE).nine_char_tool_ids
    assert not TextTokenizer.tiny(chat_template=TEMPLATE).nine_char_tool_ids
    for template, parser in ((MISTRAL_IDS_TEMPLATE, None), (PRINTED_IDS_TEMPLATE, "mistral")):
        text = prompt(template, parser)
        assert f"[TOOL_CALLS]{fitted}" in text and f"[TOOL_RESULTS]{fitted}:12:00" in text, text
        assert "[TOOL_CALLS]a1b2c3d4e" in prompt(template, parser, "a1b2c3d4e")
    assert "[TOOL_CALLS]call_Xy7" in prompt(PRINTED_IDS_TEMPLATE, "hermes")


def test_every_call_takes_the_parsers_id_form():
    """With the mistral parser, named and "required" calls get its 9-character ids too (a Mistral
    template refuses a history holding other ids); other parsers keep OpenAI's form."""
    def ids(parser, choice, text):
        request = p.ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                                          "tool_choice": choice})
        return [c.id for c in tools.finish(tools.plan(request, parser), text, "stop")[1]]
    named = {"type": "function", "function": {"name": "get_time"}}
    required = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_time", "parameters": {"zone": "CET"}}]'
    for choice, text in ((named, '{"zone": "UTC"}'), ("required", required)):
        assert all(len(i) == 9 and i.isalnum() for i in ids("mistral", choice, text))
        assert all(i.startswith("chatcmpl-tool-") for i in ids("hermes", choice, text) + ids(None, choice, text))


def test_finish_reasons_and_parallel_calls():
    two = HERMES_CALL + HERMES_CALL.replace("Oslo", "Paris")
    auto = tools.ToolPlan("auto", parser="hermes")
    assert [len(tools.finish(auto, two, "stop")[1]), tools.finish(auto, two, "stop")[2]] == [2, "tool_calls"]
    assert tools.finish(auto, two + "<tool_call>{", "length")[2] == "length"  # cut short: not a finished call
    assert tools.finish(auto, "text", "stop") == ("text", [], "stop")
    single = tools.ToolPlan("auto", parser="hermes", parallel=False)
    assert len(tools.finish(single, two, "stop")[1]) == 1
    required = tools.ToolPlan("required", parallel=False)
    assert tools.required_schema([p.Tool.model_validate(WEATHER)], parallel=False)["maxItems"] == 1
    assert tools.finish(required, '[{"name": "get_time"', "length") == ('[{"name": "get_time"', [], "length")


LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}'
MISTRAL_CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]'
STREAMED = [("hermes", t) for t in ("Sure: " + HERMES_CALL, "no call at all <tool", "<tool_call>{bad}</tool_call>",
                                    HERMES_CALL + " trailing")] + \
    [("llama3_json", t) for t in (LLAMA3_CALL, " <|python_tag|>" + LLAMA3_CALL + "; " + LLAMA3_CALL, "Text then " + LLAMA3_CALL,
                                  "<|python", LLAMA3_CALL + " trailing", "  ", ";" + LLAMA3_CALL)] + \
    [("mistral", t) for t in ("Sure: " + MISTRAL_CALL, "no call [TOOL", MISTRAL_CALL + " trailing",
                              "[TOOL_CALLS]get_weather[ARGS]{}")]


@pytest.mark.parametrize("parser, text", STREAMED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(STREAMED)])
def test_streamed_auto_equals_the_whole_text(parser, text):
    plan = tools.ToolPlan("auto", parser=parser)
    start = {"hermes": tools.HERMES_START, "llama3_json": "{", "mistral": tools.MISTRAL_START}[parser]
    whole_content, whole_calls, whole_reason = tools.finish(plan, text, "stop")
    rng = random.Random(0)
    for _ in range(20):
        stream, sent, cut = tools.ToolStream(plan), "", 0
        while cut < len(text):
            step = rng.randint(0, 5)
            sent += stream.push(text[cut : cut + step])
            assert not (whole_calls and start in sent), sent  # no part of a call is sent as text
            cut += step
        rest, calls, reason = stream.finish("stop")
        sent += rest
        assert reason == whole_reason
        assert (sent or None) == whole_content
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in whole_calls]


def test_required_schema_and_parse():
    parsed = [p.Tool.model_validate(t) for t in TOOLS]
    schema = tools.required_schema(parsed)
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = tools.parse_required('[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    assert tools.parse_required('[{"name": "get_time", "param') is None
    assert tools.parse_required('[{"name": "get_time", "parameters": {"zone": "\\ud800"}}]') is None  # not UTF-8


# ------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-num-seqs", "8", "--chat-template", TEMPLATE, "--enable-auto-tool-choice",
                   "--tool-call-parser", "hermes")
    yield s
    s.stop()


def create(server, stream=False, **kwargs):
    """(content, tool calls as (name, arguments), finish reason), streamed or not."""
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, **{"max_tokens": 32, "temperature": 0, **kwargs})
    client = server.client()
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for c in delta.tool_calls or []:
                entry = calls.setdefault(c.index, {"id": c.id, "name": None, "arguments": ""})
                entry["name"] = c.function.name or entry["name"]
                entry["arguments"] += c.function.arguments or ""
                assert entry["id"], "a call's first delta carries its id"
            reason = choice.finish_reason or reason
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], reason


@pytest.mark.parametrize("stream", [False, True], ids=["not-streamed", "streamed"])
def test_named_function(server, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    content, calls, reason = create(server, stream, tool_choice=choice)
    assert not content and [name for name, _ in calls] == ["get_time"]
    if reason == "stop":
        assert json.loads(calls[0][1])["zone"] in ("UTC", "CET")
    else:
        assert reason == "length"
    assert (content, calls, reason) == create(server, not stream, tool_choice=choice)


@pytest.mark.parametrize("stream", [False, True], ids=["not-streamed", "streamed"])
def test_required(server, stream):
    content, calls, reason = create(server, stream, tool_choice="required", max_tokens=40)
    if reason == "tool_calls":
        assert calls and not content
        for name, arguments in calls:
            assert name in ("get_weather", "get_time") and isinstance(json.loads(arguments), dict)
    else:  # the array was cut short: its text comes back as content
        assert reason == "length" and not calls and content.lstrip().startswith("[")
    assert (content, calls, reason) == create(server, not stream, tool_choice="required", max_tokens=40)


@pytest.mark.parametrize("stream", [False, True], ids=["not-streamed", "streamed"])
def test_auto_parses_hermes_calls(server, stream):
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    forced = {"structured_outputs": {"regex": "Ok " + call.replace("{", "\\{").replace("}", "\\}")}}
    content, calls, reason = create(server, stream, tool_choice="auto", extra_body=forced, max_tokens=100)
    assert reason == "tool_calls" and content == "Ok "
    assert [(n, json.loads(a)) for n, a in calls] == [("get_time", {"zone": "UTC"})]
    if stream:  # the SDK's stream helper sees each call end (the finish reason comes in a chunk of its own)
        done = []
        with server.client().chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                                     temperature=0, extra_body=forced) as events:
            done = [e.name for e in events if e.type == "tool_calls.function.arguments.done"]
        assert done == ["get_time"]
    # the default tool_choice with tools is "auto"; a reply without a call is content
    content, calls, reason = create(server, stream, max_tokens=8)
    assert calls == [] and reason in ("stop", "length") and content is not None


PARSER_OUTPUTS = {"llama3_json": ("", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}'),
                  "mistral": ("Ok ", 'Ok [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}]')}


@pytest.mark.parametrize("parser", sorted(PARSER_OUTPUTS))
def test_auto_with_each_parser(parser):
    content, output = PARSER_OUTPUTS[parser]
    s = LiveServer("--max-num-seqs", "2", "--chat-template", TEMPLATE, "--enable-auto-tool-choice",
                   "--tool-call-parser", parser)
    try:
        forced = {"structured_outputs": {"regex": re.escape(output)}}
        got, calls, reason = create(s, parser == "mistral", extra_body=forced, max_tokens=100)  # one streamed
        assert reason == "tool_calls" and (got or "") == content, got
        assert [(n, json.loads(a)) for n, a in calls] == [("get_time", {"zone": "UTC"})]
    finally:
        s.stop()


def test_none_renders_the_tools_and_returns_text(server):
    client = server.client()
    with_tools = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                max_tokens=4, temperature=0)
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert with_tools.choices[0].message.tool_calls in (None, [])
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 4


def test_earlier_calls_reach_the_template_with_dict_arguments(server):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    ids = server.post("/tokenize", {"messages": messages, "tools": TOOLS}).json()["tokens"]
    text = server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in text
    assert "<|tool|>\n18 C, sunny" in text and "Tools: get_weather get_time" in text
    reply = server.client().chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                                    max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(ids)  # /tokenize with tools counts what the chat feeds the engine


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": "x"}]}, "messages[1].tool_calls"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "get_time", "arguments": "[1]"}}]}], "tool_choice": "none"}, "messages[1].tool_calls[0].function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": 5}}}}}], "tool_choice": "required"}, "tools"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_tool_requests_are_a_400_naming_the_field(server, extra, param):
    assert_400(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}, param)


def test_auto_needs_a_parser():
    s = LiveServer("--max-num-seqs", "2", "--chat-template", TEMPLATE)
    try:
        r = s.post("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--tool-call-parser" in r.json()["error"]["message"]
        r = s.post("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4,
                                            "tool_choice": "none"})
        assert r.status_code == 200, r.text
    finally:
        s.stop()

"""The server's constrained outputs: OpenAI's ``response_format`` (``json_object``, ``json_schema``) and
vLLM's ``structured_outputs`` (JSON schema, regex, choice, grammar), streamed and not, through the
official client; their 400s name the request's field. The engine side is :mod:`test_engine_structured`.
"""

import json

import pytest
from test_serve import MODEL, LiveServer, assert_400

from pagedflash.engine.structured import StructuredOutputsParams as S

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "The weather, as JSON."}]
NESTED = {"type": "integer"}
for _ in range(70):  # past MAX_SCHEMA_DEPTH
    NESTED = {"type": "array", "items": NESTED}


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-num-seqs", "8")
    yield s
    s.stop()


def chat(server, stream=False, **kwargs):
    client = server.client()
    body = dict(model=MODEL, messages=MESSAGES, **{"max_tokens": 40, "temperature": 0, **kwargs})
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = list(client.chat.completions.create(stream=True, **body))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]


def check_matches(server, structured: S, text: str, finish: str) -> None:
    """The grammar accepts ``text``; ``"stop"``: the grammar could end there (else the tiny random
    model ran out of tokens in the free whitespace JSON allows)."""
    matcher = server.llm._grammars.grammar(structured).matcher
    assert matcher.accept_string(text), text
    assert finish == "length" or (finish == "stop" and matcher.is_completed()), (finish, text)


@pytest.mark.parametrize("stream", [False, True], ids=["not-streamed", "streamed"])
def test_json_schema_response_format(server, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    text, finish = chat(server, stream, response_format=fmt,
                        extra_body={"structured_outputs": None})  # an explicit null is no constraint
    check_matches(server, S(json=SCHEMA), text, finish)
    if finish == "stop":
        assert json.loads(text)["city"] in ("Paris", "Oslo")
    assert (text, finish) == chat(server, not stream, response_format=fmt)


def test_json_object_and_text_formats(server):
    text, finish = chat(server, response_format={"type": "json_object"}, max_tokens=60)
    check_matches(server, S(json_object=True), text, finish)
    assert text.lstrip().startswith("{")
    plain = chat(server, response_format={"type": "text"})
    assert plain == chat(server)


def test_vllm_keys_left_null_and_a_text_format_are_no_obstacle(server):
    body = {"prompt": "Answer:", "max_tokens": 10, "temperature": 0, "response_format": {"type": "text"},
            "structured_outputs": {"choice": ["yes", "no"], "structural_tag": None, "disable_fallback": True,
                                   "whitespace_pattern": None, "disable_additional_properties": False}}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")


def test_vllm_structured_outputs_on_completions(server):
    client = server.client()

    def complete(constraint, **kwargs):
        choice = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=30, temperature=0,
                                           extra_body={"structured_outputs": constraint}, **kwargs).choices[0]
        return choice.text, choice.finish_reason

    text, finish = complete({"choice": ["alpha", "beta gamma"]})
    assert finish == "stop" and text in ("alpha", "beta gamma")
    text, finish = complete({"regex": "[0-9]{2}:[0-9]{2}"})
    assert finish == "stop" and len(text) == 5 and text[2] == ":" and (text[:2] + text[3:]).isdigit()
    text, finish = complete({"grammar": 'root ::= "<" [a-z]+ ">"'}, stop=None)
    assert text.startswith("<") and (finish == "length" or text.endswith(">"))
    text, finish = complete({"json": SCHEMA, "disable_any_whitespace": True})
    assert finish == "stop" and json.loads(text)["city"] in ("Paris", "Oslo")
    # n choices each constrained; sampled
    out = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, n=3, temperature=1.0, seed=5,
                                    extra_body={"structured_outputs": {"choice": ["x", "yy", "zzz"]}})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.text in ("x", "yy", "zzz") and c.finish_reason == "stop" for c in out.choices)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "not json"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend"),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "array", "items": {}}}, "regex": "a"}},
     "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NESTED}}}, "response_format"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, param", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_a_400_naming_the_field(server, path, extra, param):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    error = assert_400(server, path, {**body, "max_tokens": 4, **extra}, param)
    assert error["message"].startswith(param.split(".")[0]) or "response_format" in error["message"] or \
        "structured_outputs" in error["message"], error

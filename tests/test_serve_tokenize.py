"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on the live server: prompts round-trip, BOS with
``add_special_tokens``, a chat's count equals the prompt tokens ``/v1/chat/completions`` reports,
``return_token_strs``, and the refusals (a model not served, ids outside the vocabulary, bad bodies)."""

import pytest
from test_serve import GREEDY, MODEL, LiveServer, assert_400

TEXT = "héllo wörld 😀 ✓ naïve — 日本語 done"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-num-seqs", "4")
    yield s
    s.stop()


def ok(server, path, body) -> dict:
    r = server.post(path, body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("text", ["Hello, world!", TEXT, ""])
def test_a_prompt_round_trips_through_detokenize(server, text):
    tok = server.state.tokenizer
    out = ok(server, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})
    assert out == {"count": len(out["tokens"]), "max_model_len": server.state.max_model_len,
                   "tokens": tok.encode(text, add_special_tokens=False), "token_strs": None}
    assert ok(server, "/detokenize", {"model": MODEL, "tokens": out["tokens"]}) == {"prompt": text}


def test_add_special_tokens_adds_bos_by_default_and_detokenize_writes_it(server):
    bare = ok(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})["tokens"]
    default = ok(server, "/tokenize", {"prompt": TEXT})
    assert default["tokens"] == [1, *bare] and default["count"] == len(bare) + 1  # <s> is id 1
    assert ok(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": True})["tokens"] == default["tokens"]
    assert ok(server, "/detokenize", {"tokens": default["tokens"]})["prompt"] == "<s>" + TEXT


def test_a_prompt_is_counted_past_the_context_length(server):
    text = " ".join(str(i) for i in range(400))
    out = ok(server, "/tokenize", {"prompt": text})
    assert out["count"] == len(server.state.tokenizer.encode(text)) > out["max_model_len"]


def test_a_chat_is_counted_past_the_context_length(server):
    long = [{"role": "user", "content": " ".join(str(i) for i in range(400))}]
    out = ok(server, "/tokenize", {"messages": long})
    assert out["count"] > out["max_model_len"]
    assert server.post("/v1/chat/completions", {"messages": long, "max_tokens": 1}).status_code == 400


def test_messages_count_what_chat_completions_feed_the_engine(server):
    out = ok(server, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    chat = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **GREEDY)
    assert chat.usage.prompt_tokens == out["count"] == len(out["tokens"])
    rendered = server.state.tokenizer.render_chat(MESSAGES)
    assert ok(server, "/detokenize", {"tokens": out["tokens"]})["prompt"] == rendered
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    assert ok(server, "/tokenize", {"messages": parts})["tokens"] == out["tokens"]

    bare = ok(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert out["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < out["count"]
    assert ok(server, "/detokenize", {"tokens": bare["tokens"]})["prompt"] == \
        server.state.tokenizer.render_chat(MESSAGES, add_generation_prompt=False)


@pytest.mark.parametrize("body", [{"prompt": TEXT}, {"messages": MESSAGES}], ids=["prompt", "messages"])
def test_return_token_strs_gives_each_tokens_text(server, body):
    tok = server.state.tokenizer
    out = ok(server, "/tokenize", {**body, "return_token_strs": True})
    assert out["token_strs"] == [tok.token_text(t) for t in out["tokens"]] and len(out["token_strs"]) == out["count"]
    assert ok(server, "/tokenize", {**body, "return_token_strs": False})["token_strs"] is None
    if "prompt" in body:  # characters split across tokens show as U+FFFD, whole ones as themselves
        assert out["token_strs"][0] == "<s>" and "\ufffd" in "".join(out["token_strs"])
    else:
        assert "".join(out["token_strs"]) == tok.render_chat(MESSAGES)


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": MESSAGES}),
                                        ("/detokenize", {"tokens": [5]})], ids=["prompt", "messages", "tokens"])
def test_a_model_not_served_gets_the_completions_refusal(server, path, body):
    want = server.post("/v1/completions", {"model": "other", "prompt": "hi"})
    got = server.post(path, {"model": "other", **body})
    assert got.status_code == want.status_code == 400
    assert got.json() == want.json() and got.json()["error"]["code"] == "model_not_found"


BAD = [
    ("/tokenize", b'{"prompt": ', None),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 512]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    error = assert_400(server, path, body, param)
    if path == "/detokenize" and param == "tokens" and isinstance(body.get("tokens"), list):
        assert "outside the vocabulary [0, 512)" in error["message"]


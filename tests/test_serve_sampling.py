"""The server's sampling fields beyond temperature/top-k/top-p: ``n`` choices per prompt (indices,
finish chunks, usage, seeds, aborts), ``logit_bias``, the penalties and ``min_p`` (mapped onto
:class:`~pagedflash.engine.SamplingParams`, and their effect on the tiny model's tokens), and
completions' ``echo`` (text, prompt logprobs, streamed, ``max_tokens: 0``). Their 400s are in
:data:`test_serve.BAD`; across the engine process in :mod:`test_serve_process`.
"""

import httpx
import pytest
from test_serve import GREEDY, MODEL, TIMEOUT, LiveServer, finished, slow_steps

from pagedflash.entrypoints.openai import protocol as p
from pagedflash.entrypoints.openai import serving
from pagedflash.entrypoints.openai.tokenizer import TextTokenizer

SAMPLED = dict(temperature=1.0, extra_body={"ignore_eos": True})
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server():
    s = LiveServer("--max-num-seqs", "16")
    yield s
    s.stop()


def by_index(chunks) -> dict[int, list]:
    """A stream's choice entries by their index (usage chunks have none)."""
    out: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out.setdefault(choice.index, []).append(choice)
    return out


def streamed_texts(chunks) -> dict[int, str]:
    """Each choice's text (completions) or content (chat), joined over a stream."""
    return {i: "".join((c.text if hasattr(c, "text") else c.delta.content) or "" for c in entries)
            for i, entries in by_index(chunks).items()}


def finish_reasons(chunks) -> dict[int, list[str]]:
    return {i: [c.finish_reason for c in entries if c.finish_reason] for i, entries in by_index(chunks).items()}


# ------------------------------------------------------------------ the mapping, without a server
@pytest.fixture(scope="module")
def state():
    return serving.ServerState(engine=None, tokenizer=TextTokenizer.tiny(), model_name=MODEL, max_model_len=1024,
                               vocab_size=512, pool_tokens=1200)


def params_of(state, body, prompt_len=4, **kwargs):
    request = p.CompletionRequest.model_validate({"prompt": "x", **body})
    serving.check_request(state, request)
    return serving.sampling_params(state, request, prompt_len, default_max_tokens=None, **kwargs)


def test_request_fields_map_onto_sampling_params(state):
    [one] = params_of(state, {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
                              "min_p": 0.2, "logit_bias": {"7": 100, "011": -3.5}, "max_tokens": 4})
    assert (one.presence_penalty, one.frequency_penalty, one.repetition_penalty, one.min_p) == (0.5, -1, 1.3, 0.2)
    assert one.logit_bias == {7: 100.0, 11: -3.5} and one.prompt_logprobs is None
    [off] = params_of(state, {"min_p": None, "presence_penalty": None, "repetition_penalty": None, "logit_bias": {}})
    assert (off.min_p, off.presence_penalty, off.repetition_penalty, off.logit_bias) == (0.0, 0.0, 1.0, None)
    assert not off.adjusts_logits

    seeded = params_of(state, {"n": 3, "seed": 40, "max_tokens": 2})
    assert [x.seed for x in seeded] == [40, 41, 42] and all(x.max_tokens == 2 for x in seeded)
    unseeded = params_of(state, {"n": 3})
    assert len(unseeded) == 3 and all(x.seed is None for x in unseeded)
    # the default max_tokens: the room the prompt leaves in max_model_len and in the pool, shared by the n choices
    assert params_of(state, {})[0].max_tokens == 1024 - 4 and unseeded[0].max_tokens == (1200 - 4) // 3 + 1

    [echo] = params_of(state, {"echo": True, "logprobs": 2, "max_tokens": 3})
    assert echo.prompt_logprobs == 2 and echo.logprobs == 2 and echo.max_tokens == 3
    # a non-streamed echo's prompt logprobs come from the first choice (the others hit the prefix cache)
    assert [x.prompt_logprobs for x in params_of(state, {"echo": True, "logprobs": 1, "n": 3})] == [1, None, None]
    assert [x.prompt_logprobs for x in params_of(state, {"echo": True, "logprobs": 1, "n": 2, "stream": True})] == [1, 1]
    [bare] = params_of(state, {"echo": True, "max_tokens": 0})  # one token, dropped by the Generation
    assert bare.max_tokens == 1 and bare.prompt_logprobs is None


# ------------------------------------------------------------------ n
def test_n_completions_streamed_and_not(server):
    """Greedy choices of a prompt are equal: choice ``i * n + j`` is prompt ``i``'s, as a request with n=1 gives it."""
    client = server.client()
    prompts = [[5, 6], [7, 8, 9]]
    single = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, **GREEDY)
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2, **GREEDY)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [single.choices[i // 2].text for i in range(4)]
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.prompt_tokens == 5 and whole.usage.completion_tokens == 8  # prompts once, every choice
    assert whole.usage.total_tokens == 13

    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert streamed_texts(chunks) == {c.index: c.text for c in whole.choices}
    assert finish_reasons(chunks) == {i: ["length"] for i in range(4)}  # each choice its own finish chunk
    assert all(len(c.choices) <= 1 for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 5
    assert chunks[-1].usage.completion_tokens == 8
    server.assert_pool_whole()


def test_n_chat_streamed_and_not_with_a_seed(server):
    client = server.client()
    messages = [{"role": "user", "content": "Hello, world!"}]
    asked = dict(model=MODEL, messages=messages, max_tokens=3, n=3, seed=11, **SAMPLED)
    whole = client.chat.completions.create(**asked)
    n_prompt = len(server.state.tokenizer.encode(server.state.tokenizer.render_chat(messages),
                                                 add_special_tokens=False))
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.prompt_tokens == n_prompt and whole.usage.completion_tokens == 9

    chunks = list(client.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [(i, "assistant") for i in range(3)] and all(c.choices[0].delta.role for c in chunks[:3])
    assert streamed_texts(chunks) == {c.index: c.message.content for c in whole.choices}  # seeded: the same draws
    assert finish_reasons(chunks) == {i: ["length"] for i in range(3)}
    assert chunks[-1].usage.prompt_tokens == n_prompt and chunks[-1].usage.completion_tokens == 9


def test_seeded_choices_are_reproducible_and_differ(server):
    """Choice j draws with seed + j: a request repeated gives the same choices, choice 2 is what n=1
    with seed + 2 gives, and the choices (4 tokens over the random model's ~flat 512-token
    distribution each) are not all equal."""
    client = server.client()
    asked = dict(model=MODEL, prompt=PROMPT, max_tokens=4, n=4, seed=1234, **SAMPLED)
    first = [c.text for c in client.completions.create(**asked).choices]
    again = [c.text for c in client.completions.create(**asked).choices]
    assert first == again
    assert len(set(first)) > 1, first
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, seed=1236, **SAMPLED)
    assert alone.choices[0].text == first[2]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_disconnect_aborts_every_choice(server, stream):
    before = server.wait_idle()
    body = {"prompt": [7, 8, 9], "max_tokens": 500, "n": 3, "ignore_eos": True, "temperature": 0, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data:"))
    else:
        with slow_steps(server), pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=1.5))
    after = server.wait_idle()
    assert finished(after, "abort") == finished(before, "abort") + 3
    server.assert_pool_whole()


# ------------------------------------------------------------------ logit_bias, penalties, min_p
def test_logit_bias_steers_greedy_and_sampled_tokens(server):
    client = server.client()
    tok = server.state.tokenizer
    for kwargs in (GREEDY, dict(SAMPLED, seed=5)):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=0,
                                        logit_bias={"42": 100}, **kwargs)
        assert out.choices[0].logprobs.tokens == [tok.token_text(42)] * 4, kwargs
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logit_bias={"42": 100}, logprobs=True, **GREEDY)
    assert [e.token for e in chat.choices[0].logprobs.content] == [tok.token_text(42)] * 3
    plain = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, logprobs=0, **GREEDY)
    first = plain.choices[0].logprobs.tokens[0]
    ban = {str(t): -100 for t in range(512) if tok.token_text(t) == first}  # byte tokens share one text
    banned = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, logprobs=0, logit_bias=ban,
                                       **GREEDY)
    assert banned.choices[0].logprobs.tokens[0] != first


def test_penalties_and_min_p_change_the_tokens(server):
    """repetition_penalty 1e4 takes every seen token's logit to ~0 or far below (the random model has
    positive logits among the unseen ones at every step): greedy never repeats a prompt or output
    token. min_p 1 keeps the top token only: sampling gives the greedy text."""
    client = server.client()
    tok = server.state.tokenizer
    prompt = [5, 6, 7, 5, 6, 7]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=0, temperature=0,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1e4})
    texts = [t for t in out.choices[0].logprobs.tokens if "\ufffd" not in t]  # byte tokens share one text
    seen = {tok.token_text(t) for t in prompt}
    assert len(set(texts)) == len(texts) and not seen & set(texts), (texts, seen)
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **GREEDY).choices[0].text
    pinned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, seed=3, temperature=1.0,
                                       extra_body={"ignore_eos": True, "min_p": 1.0})
    assert pinned.choices[0].text == greedy
    both = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, presence_penalty=1.5,
                                     frequency_penalty=-0.5, **SAMPLED)
    assert both.usage.completion_tokens == 2


# ------------------------------------------------------------------ echo
def test_echo_text_and_logprobs_streamed_and_not(server):
    client = server.client()
    tok = server.state.tokenizer
    ids = tok.encode(PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=1, **GREEDY)
    text = plain.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + text and echoed.choices[0].logprobs is None
    assert echoed.usage.prompt_tokens == len(ids) and echoed.usage.completion_tokens == 3

    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, **GREEDY)
    lp = whole.choices[0].logprobs
    assert whole.choices[0].text == PROMPT + text
    assert lp.tokens == [tok.token_text(t) for t in ids] + plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    for token_lp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert token_lp <= 0 and token_lp <= max(top.values()) + 1e-6 and 1 <= len(top) <= 2
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    # a prompt position's top entry is the greedy token a request on the prompt up to there gives
    head = client.completions.create(model=MODEL, prompt=ids[:3], max_tokens=1, logprobs=1, **GREEDY)
    assert max(lp.top_logprobs[3].values()) == pytest.approx(head.choices[0].logprobs.token_logprobs[0], abs=1e-4)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1,
                                            stream=True, **GREEDY))
    assert chunks[0].choices[0].text.startswith(PROMPT)  # the prompt in the first chunk
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [t for c in chunks for t in c.choices[0].logprobs.text_offset] == lp.text_offset
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    server.assert_pool_whole()


def test_echo_with_n_and_a_batch_and_without_generation(server):
    client = server.client()
    tok = server.state.tokenizer
    prompts = [[1, 300, 301], [7, 8, 9]]
    texts = [tok.decode(ids, skip_special_tokens=False) for ids in prompts]  # token ids echo as their text,
    assert texts[0] != tok.decode(prompts[0])  # special tokens (here a BOS) included
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2, echo=True, seed=9, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert c.text.startswith(texts[c.index // 2]) and len(c.text) > len(texts[c.index // 2])
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=2, echo=True, seed=9,
                                            stream=True, **SAMPLED))
    assert streamed_texts(chunks) == {c.index: c.text for c in out.choices}
    firsts = {}
    for chunk in chunks:
        firsts.setdefault(chunk.choices[0].index, chunk.choices[0].text)
    assert all(firsts[i].startswith(texts[i // 2]) for i in range(4))

    scored = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, n=3, echo=True, logprobs=1, **SAMPLED)
    for c in scored.choices:  # every choice shows its prompt's entries, computed by the prompt's first choice
        first = scored.choices[c.index - c.index % 3].logprobs
        assert c.logprobs.token_logprobs[:3] == first.token_logprobs[:3] and c.logprobs.token_logprobs[0] is None
        assert all(x <= 0 for x in c.logprobs.token_logprobs[1:])

    bare = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, **GREEDY)
    choice = bare.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and bare.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [tok.token_text(t) for t in tok.encode(PROMPT)]
    assert choice.logprobs.token_logprobs[0] is None and all(x <= 0 for x in choice.logprobs.token_logprobs[1:])
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, stream=True,
                                            **GREEDY))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks] == [(PROMPT, "length")]
    server.assert_pool_whole()

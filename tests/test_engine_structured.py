"""Structured outputs in the engine (``SamplingParams.structured_outputs``, through xgrammar): every
constraint kind, greedy and sampled, beside unconstrained rows; chunked prefill and preemption; a
failed step; the raw logprobs; bad grammars refused at ``add_request``. Tiny random Llama with the
server's tiny byte-level tokenizer, fp32 (on a GPU: compiled, with CUDA graphs and run-ahead).

What a constrained request generates is checked against a fresh matcher of the same grammar: it
accepts every token, and a request that finished with ``"stop"`` ended the grammar.
"""

import json

import pytest
import torch

from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine.config import TINY_LLAMA
from pagedflash.engine.structured import StructuredOutputsParams as S

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from pagedflash.entrypoints.openai.tokenizer import tiny_tokenizer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "colour", "n"], "additionalProperties": False}
KINDS = {
    "json": S(json=SCHEMA, disable_any_whitespace=True),
    "json_text_any_space": S(json=json.dumps(SCHEMA)),
    "json_object": S(json_object=True),
    "regex": S(regex=r"[0-9]{3}-[a-z]{2}"),
    "choice": S(choice=["yes", "no way", 'a "quoted" \\ one']),
    "grammar": S(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'),
}
PROMPTS = ["The answer is", "hello there, how are you", "x", "Write JSON:"]


def make_llm(**kwargs):
    kwargs = {"num_blocks": 64, "page_size": 16, "max_num_seqs": 8, **kwargs}
    return LLM(dict(TINY_LLAMA), dtype=torch.float32, tokenizer=tiny_tokenizer(), device=DEVICE, **kwargs)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def check_accepted(llm, structured: S, out) -> None:
    """A fresh matcher accepts every generated token; ``"stop"`` means it ended there."""
    matcher = llm._grammars.grammar(structured).matcher
    for t in out.token_ids:
        assert matcher.accept_token(t), (structured.kind, out.token_ids, out.text)
    assert matcher.is_terminated() == (out.finish_reason == "stop"), (out.finish_reason, out.text)


def test_params_are_checked():
    for bad, match in [(dict(), "exactly one"), (dict(json={}, regex="a"), "exactly one"),
                       (dict(json=3), "structured_outputs.json"), (dict(choice=[]), "structured_outputs.choice"),
                       (dict(choice=["a", 1]), "structured_outputs.choice"), (dict(regex=""), "structured_outputs.regex"),
                       (dict(grammar=5), "structured_outputs.grammar"),
                       (dict(json_object=True, disable_any_whitespace="yes"), "disable_any_whitespace")]:
        with pytest.raises(ValueError, match=match):
            S(**bad)
    nested = {"type": "integer"}
    for _ in range(65):
        nested = {"type": "array", "items": nested}
    for bad, match in [(dict(json=nested), "more than 64 deep"), (dict(json={"enum": {1, 2}}), "is not JSON"),
                       (dict(json="{"), "is not JSON"), (dict(regex="a" * 70000), "at most 65536"),
                       (dict(choice=["a"] * 1025), "at most 1024")]:
        with pytest.raises(ValueError, match=match):
            S(**bad)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    assert SamplingParams(structured_outputs=S(regex="a")).adjusts_logits
    assert not SamplingParams(structured_outputs=S(regex="a")).raw_greedy


def test_every_kind_greedy_and_sampled_beside_unconstrained_rows(llm):
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    kinds = [(kind, s, t) for t in (0.0, 1.0) for kind, s in KINDS.items()]
    params = [SamplingParams(max_tokens=48, temperature=t, seed=i, structured_outputs=s)
              for i, (_, s, t) in enumerate(kinds)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts + PROMPTS[:2], params + [free, free])
    for (kind, structured, temperature), out in zip(kinds, outs):
        check_accepted(llm, structured, out)
        if kind in ("json", "regex", "choice", "grammar") and temperature == 0.0:  # no free whitespace
            assert out.finish_reason == "stop", (kind, out.text)
    by_kind = {kind: out for (kind, _, t), out in zip(kinds, outs) if t == 0.0}
    value = json.loads(by_kind["json"].text)
    assert set(value) == {"ok", "colour", "n"} and value["colour"] in ("red", "blue") and 0 <= value["n"] <= 9
    assert by_kind["choice"].text in KINDS["choice"].choice
    # the unconstrained rows generate what they generate alone
    alone = llm.generate(PROMPTS[:2], free)
    assert [o.token_ids for o in outs[-2:]] == [o.token_ids for o in alone]


def test_seeded_constrained_rows_alone_and_batched(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, structured_outputs=KINDS["json_object"])
    alone = llm.generate([PROMPTS[0]], params)[0]
    batched = llm.generate(PROMPTS, [params] + [SamplingParams(max_tokens=12, temperature=1.0)] * 3)[0]
    assert alone.token_ids == batched.token_ids


def test_chunked_prefill_and_preemption_keep_the_grammar():
    """A pool too small for the batch preempts (recompute) rows mid-output; their grammars go on
    where they were."""
    params = [SamplingParams(max_tokens=24, structured_outputs=KINDS[k]) for k in ("json", "grammar", "choice")]
    prompts = [PROMPTS[i] * 2 for i in range(len(params))]
    roomy = make_llm().generate(prompts, params)
    tight = make_llm(num_blocks=7, page_size=8, max_num_batched_tokens=16)
    outs = tight.generate(prompts, params)
    assert tight.last_stats["preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_a_failed_step_leaves_the_grammars_as_they_were(llm):
    params = SamplingParams(max_tokens=24, structured_outputs=KINDS["json"])
    expected = llm.generate([PROMPTS[1]], params)[0].token_ids
    rid = llm.add_request(PROMPTS[1], params)
    got: list[int] = []
    launch, calls = llm.runner.launch, [0]

    def failing(batch):
        calls[0] += 1
        pending = launch(batch)
        if calls[0] % 3 == 0:
            pending.result()
            raise RuntimeError("injected after the pick")
        return pending

    llm.runner.launch = failing
    try:
        for _ in range(100):  # 24 tokens, a third of the steps failing: bounded
            if not llm.has_unfinished_requests():
                break
            try:
                outs = llm.step()
            except RuntimeError:
                continue
            got += [t for o in outs if o.request_id == rid for t in o.new_token_ids]
    finally:
        del llm.runner.launch
    assert got == expected


def test_logprobs_are_the_raw_logits(llm):
    """A one-choice grammar forces its tokens; their logprobs are the raw model's, not 0."""
    forced = SamplingParams(max_tokens=10, logprobs=0, structured_outputs=S(choice=["blue moon"]))
    out = llm.generate([PROMPTS[0]], forced)[0]
    assert out.text == "blue moon" and out.finish_reason == "stop"
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, prompt_logprobs=0, logprobs=0))[0]
    first = out.token_ids[0]
    assert out.logprobs[0][first] < 0.0
    # the forced first token's logprob equals the raw distribution's at that position
    raw = llm.generate([llm.tokenizer.encode(PROMPTS[0]) + [first]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.logprobs[0][first] == pytest.approx(raw.prompt_logprobs[-1][first], abs=1e-5)
    assert free.logprobs[0][free.token_ids[0]] >= out.logprobs[0][first]


def test_bad_grammars_are_refused_at_add_request(llm):
    for structured, match in [(S(json='{"type": 5}'), "structured_outputs.json: xgrammar cannot compile"),
                              (S(json='{"type": "object", "properties": 5}'), "structured_outputs.json"),
                              (S(regex="(ab"), "structured_outputs.regex"),
                              (S(grammar="root ::= "), "structured_outputs.grammar")]:
        with pytest.raises(ValueError, match=match):
            llm.add_request(PROMPTS[0], SamplingParams(structured_outputs=structured))
    assert not llm.has_unfinished_requests()
    out = llm.generate([PROMPTS[0]], SamplingParams(structured_outputs=S(regex="(ab")))[0]
    assert out.finish_reason == "error" and "structured_outputs.regex" in out.error


def test_a_grammar_no_token_can_begin_is_refused_and_a_stuck_one_stops(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex: no token of the vocabulary can begin"):
        llm.add_request(PROMPTS[0], SamplingParams(structured_outputs=S(regex="[^\\s\\S]")))
    assert not llm.has_unfinished_requests()
    # a row whose grammar allows nothing next may take the stop tokens only: the request ends there
    from pagedflash.engine.structured import fill_bitmask

    grammar = llm._grammars.grammar(KINDS["regex"])
    batch = grammar.compiler.batch

    class Stuck:
        def batch_fill_next_token_bitmask(self, matchers, bitmask, indices):
            batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=indices)
            bitmask[indices[0]] = 0

    grammar.compiler.batch = Stuck()
    try:
        mask = fill_bitmask([None, grammar], [1], 512)
    finally:
        grammar.compiler.batch = batch
    allowed = [t for t in range(512) if mask[1, t // 32] >> (t % 32) & 1]
    assert allowed == sorted(llm.eos_ids)
    assert not grammar.accept(allowed[0]) or grammar.terminated


def test_an_engine_without_a_tokenizer_says_so():
    llm = LLM(dict(TINY_LLAMA), dtype=torch.float32, num_blocks=16, page_size=16, device=DEVICE)
    with pytest.raises(ValueError, match="structured_outputs needs the engine's tokenizer"):
        llm.add_request([1, 2, 3], SamplingParams(structured_outputs=S(json_object=True)))
    assert not llm.has_unfinished_requests()


def test_compile_grammar_on_another_thread():
    """``compile_grammar`` (the server's grammar threads) fills the cache ``add_request`` then finds, and
    raises what ``add_request`` would; ``grammar_compiled`` says which grammars it compiled lately."""
    import threading

    llm = make_llm()
    params = SamplingParams(max_tokens=8, structured_outputs=S(json=SCHEMA, disable_any_whitespace=True))
    same = SamplingParams(max_tokens=8, structured_outputs=S(json=json.loads(json.dumps(SCHEMA)),
                                                             disable_any_whitespace=True))
    assert not llm.grammar_compiled(params)
    errors = []
    threads = [threading.Thread(target=lambda: errors.append(llm.compile_grammar(params))) for _ in range(2)]
    for t in threads:  # two at once: the compiler is built once, under its lock
        t.start()
    for t in threads:
        t.join()
    assert errors == [None, None] and llm.grammar_compiled(params) and llm.grammar_compiled(same)
    assert not llm.grammar_compiled(SamplingParams(structured_outputs=S(json=SCHEMA)))  # any whitespace: another
    assert not llm.grammar_compiled(SamplingParams())
    llm.compile_grammar(SamplingParams())  # nothing to compile
    out = llm.generate([PROMPTS[0]], same)[0]
    check_accepted(llm, same.structured_outputs, out)
    with pytest.raises(ValueError, match="structured_outputs.regex: xgrammar cannot compile"):
        llm.compile_grammar(SamplingParams(structured_outputs=S(regex="(ab")))
    assert not llm.grammar_compiled(SamplingParams(structured_outputs=S(regex="(ab")))

"""The step API: add_request / step / has_unfinished_requests / abort_request.

``generate`` is a loop over ``step``: a manual loop gives the same tokens (greedy and seeded sampled
rows, preemption, chunked prefill, prefix hits, run-ahead), and concatenating a request's
``new_token_ids`` over the steps streams exactly its final output."""

import pytest
import torch

from pagedflash.engine import LLM, RequestOutput, SamplingParams
from pagedflash.engine.config import TINY_LLAMA

MODEL = {**TINY_LLAMA, "vocab_size": 128, "max_position_embeddings": 256, "initializer_range": 0.3}


def engine(**kwargs) -> LLM:
    return LLM(MODEL, dtype=torch.float32, seed=0, **kwargs)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = tokens(9, 100)
PROMPTS = [SYSTEM + tokens(4, 1), tokens(13, 2), SYSTEM + tokens(2, 3), tokens(3, 4), tokens(7, 5)]
PARAMS = [SamplingParams(max_tokens=7, ignore_eos=True),
          SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
          SamplingParams(max_tokens=9, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=4, ignore_eos=True)]
# 10 pages of 4 for five requests of up to 22 tokens: preempts; 12 tokens a step: chunked prefill
ENGINE = dict(page_size=4, num_blocks=10, max_num_batched_tokens=12)


def stream(llm: LLM, prompts, params) -> tuple[dict, dict, int]:
    """Drive ``llm`` with the step API; returns (request id -> streamed tokens, id -> last output,
    number of steps), checking every output on the way."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    streamed = {i: [] for i in ids}
    last: dict[int, RequestOutput] = {}
    steps = 0
    while llm.has_unfinished_requests():
        outs = llm.step()
        steps += 1
        assert len({o.request_id for o in outs}) == len(outs)
        for out in outs:
            assert isinstance(out, RequestOutput) and out.request_id in streamed
            assert out.request_id not in last or not last[out.request_id].finished, "output after finishing"
            assert out.new_token_ids, "a request without a new token was reported"
            streamed[out.request_id] += out.new_token_ids
            assert out.token_ids == streamed[out.request_id]
            assert out.prompt_token_ids == prompts[ids.index(out.request_id)]
            assert out.finished == (out.finish_reason is not None)
            last[out.request_id] = out
    assert llm.step() == []
    return streamed, last, steps


@pytest.mark.parametrize("run_ahead", [True, False], ids=["run_ahead", "synchronous"])
def test_step_loop_equals_generate(run_ahead):
    ref = engine(**ENGINE)
    ref.run_ahead.enabled = run_ahead
    want = ref.generate(PROMPTS, PARAMS)
    assert ref.last_stats["preemptions"] > 0 and ref.block_manager.stats.hit_tokens > 0
    llm = engine(**ENGINE)
    llm.run_ahead.enabled = run_ahead
    streamed, last, steps = stream(llm, PROMPTS, PARAMS)
    assert steps == ref.last_stats["steps"]
    assert [streamed[i] for i in sorted(streamed)] == [o.token_ids for o in want]
    assert [last[i].finish_reason for i in sorted(last)] == [o.finish_reason for o in want] == ["length"] * 5
    assert all(last[i].finished for i in last)
    assert llm.block_manager.num_free_blocks == ENGINE["num_blocks"] and not llm.scheduler.running


def test_streaming_with_stops_and_a_second_wave():
    """Requests added while others run; stop ids end some early; each request is reported once finished."""
    llm = engine(page_size=4, num_blocks=32)
    ref = engine(page_size=4, num_blocks=32).generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop = SamplingParams(max_tokens=8, stop_token_ids=[ref.token_ids[2]], ignore_eos=True)
    first = llm.add_request(PROMPTS[0], stop)
    other = llm.add_request(PROMPTS[3])  # default SamplingParams: 16 greedy tokens
    outs = llm.step()
    assert [o.request_id for o in outs] == [first, other]  # both prompts fit in one step
    late = llm.add_request(PROMPTS[4], SamplingParams(max_tokens=3, ignore_eos=True))
    got = {first: outs[0].new_token_ids, other: outs[1].new_token_ids, late: []}
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out
    t = ref.token_ids
    assert got[first] == t[: t.index(t[2]) + 1] and finished[first].finish_reason == "stop"
    assert len(got[late]) == 3 and finished[late].finish_reason == "length"
    assert set(finished) == {first, other, late}


def test_abort_request():
    llm = engine(page_size=4, num_blocks=8, max_num_seqs=2)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    a, b, c = (llm.add_request(p, params) for p in PROMPTS[3:5] + PROMPTS[1:2])  # c waits: two rows at most
    for _ in range(3):
        llm.step()
    free = llm.block_manager.num_free_blocks
    held = len(llm.block_manager.block_table(a))
    assert llm.abort_request(a) is True  # running, with a decode step maybe in flight ahead
    assert llm.block_manager.num_free_blocks == free + held and a not in llm.block_manager
    assert llm.abort_request(c) is True  # still waiting
    assert llm.abort_request(a) is False and llm.abort_request(c) is False  # already aborted: no-op
    with pytest.raises(ValueError, match="request_id 99 was never returned"):
        llm.abort_request(99)
    with pytest.raises(ValueError, match="request_id 'x' was never returned"):
        llm.abort_request("x")
    rest = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id == b
            rest.append(out)
    assert rest[-1].finished and len(rest[-1].token_ids) == 10
    assert llm.abort_request(b) is False  # finished
    assert llm.block_manager.num_free_blocks == 8
    want = engine(page_size=4, num_blocks=8).generate([PROMPTS[4]], params)[0]
    assert rest[-1].token_ids == want.token_ids


def test_add_request_refuses_bad_requests_and_queues_nothing():
    llm = engine(page_size=4, num_blocks=8)
    cases = [
        ([], ValueError, "prompt is empty"),
        ([1, 2**63], ValueError, r"token id 9223372036854775808 is outside the vocabulary \[0, 128\)"),
        ([1, -1], ValueError, "token id -1 is outside the vocabulary"),
        ([1, 2.0], TypeError, "got an element 2.0 of type float"),
        ([True], TypeError, "got an element True of type bool"),
        ("text", TypeError, "no tokenizer"),
        (7, TypeError, "got int"),
        (list(range(100)) * 3, ValueError, "more than the model's maximum length 256"),
    ]
    for prompt, exc, match in cases:
        with pytest.raises(exc, match=match):
            llm.add_request(prompt)
    with pytest.raises(ValueError, match="top_p"):
        bad = SamplingParams()
        bad.top_p = 2.0
        llm.add_request([1, 2], bad)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams, got dict"):
        llm.add_request([1, 2], {"max_tokens": 3})
    with pytest.raises(ValueError, match="never fit"):
        llm.add_request([1, 2], SamplingParams(max_tokens=40))
    assert not llm.has_unfinished_requests() and llm.step() == []


def test_generate_needs_an_idle_engine():
    llm = engine(page_size=4, num_blocks=8)
    rid = llm.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="1 requests of add_request are unfinished"):
        llm.generate([[1, 2, 3]])
    assert llm.abort_request(rid)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"


@pytest.mark.parametrize("dtype", [torch.float64, "float64", torch.int32, torch.complex64, 16])
def test_unsupported_dtype_refused_at_construction(dtype):
    with pytest.raises(ValueError, match=r"dtype must be torch.float32, torch.float16 or torch.bfloat16 .* got"):
        LLM(MODEL, dtype=dtype, num_blocks=4)


def test_bf16_refused_on_the_cpu():
    """The interpreter's bf16 dots are wrong (the tiny model's logits lose every argmax): refused, not served."""
    with pytest.raises(ValueError, match="dtype torch.bfloat16 is not supported on the CPU"):
        LLM(MODEL, dtype="bf16", device="cpu", num_blocks=4)


def test_prompt_logits_checks_prompts():
    llm = engine(page_size=4, num_blocks=8)
    with pytest.raises(ValueError, match=r"prompts\[1\]: token id 9223372036854775808 is outside the vocabulary"):
        llm.prompt_logits([[1, 2], [3, 2**63]])
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt is empty"):
        llm.prompt_logits([[]])
    assert llm.block_manager.num_free_blocks == 8


def test_parameters_changed_after_add_request_do_not_reach_the_request():
    """A request runs with the SamplingParams it was checked with: changing the object (or its
    stop_token_ids list) afterwards changes nothing, and no step fails halfway."""
    llm = engine(num_blocks=16)
    want = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    params = SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[])
    request = llm.add_request(PROMPTS[1], params)
    params.logprobs, params.max_tokens, params.temperature = 2, 1, 1.0
    params.stop_token_ids.append(want[0])
    got = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id == request and out.new_logprobs is None
            got += out.new_token_ids
    assert got == want

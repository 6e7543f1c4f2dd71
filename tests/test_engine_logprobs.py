"""Logprobs in the engine: ``SamplingParams(logprobs=k, prompt_logprobs=k)``.

Every entry must equal ``torch.log_softmax`` of the reference logits (``LLM.prompt_logits``, one
packed prefill of the prompt and the generated tokens) at its position, in fp32: the generated or
given token always in the dict, then the top ``k`` of the reference; through chunked prefill,
decode steps, one-token prefill chunks inside decode steps, prefix-cache hits (recomputed, the
shared pages never written) and preemption. Streaming step outputs carry the same entries; rows
asking for logprobs change no token; bad ``k`` values raise naming the field; steps without
logprob rows do no logprob work and keep running ahead; two tensor-parallel ranks give one rank's
entries.
"""

import pytest
import torch
from helpers import ON_GPU, TWO_GPUS

from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine import logprobs as logprobs_mod
from pagedflash.engine.config import TINY_LLAMA
from pagedflash.engine.sampling import MAX_LOGPROBS

VOCAB = 128
MODEL = {**TINY_LLAMA, "vocab_size": VOCAB, "max_position_embeddings": 256, "initializer_range": 0.3}
ATOL = 2e-5  # fp32: the same logits through other chunkings and batches


def engine(**kwargs) -> LLM:
    return LLM(MODEL, dtype=torch.float32, seed=0, **kwargs)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def reference():
    """fp32 log-softmax ``[len(ids), vocab]`` at every position of each of ``seqs`` (position ``i``
    predicts token ``i + 1``), from one packed prefill."""
    llm = engine(page_size=8, num_blocks=64, enable_prefix_caching=False)
    return lambda seqs: [logits.log_softmax(-1) for logits in llm.prompt_logits(seqs)]


def check_entry(entry: dict, token: int, ref_row: torch.Tensor, k: int, what: str) -> None:
    """``entry`` holds ``token`` (first) and the top ``k`` of ``ref_row``, with ``ref_row``'s values."""
    assert next(iter(entry)) == token, f"{what}: the token is not the first key"
    top = ref_row.topk(k)
    want = {token, *top.indices.tolist()}
    assert set(entry) == want, f"{what}: keys {sorted(entry)} != token {token} + top {k} {top.indices.tolist()}"
    for t, v in entry.items():
        assert isinstance(t, int) and isinstance(v, float)
        assert abs(v - ref_row[t].item()) <= ATOL, f"{what}: token {t}: {v} vs {ref_row[t].item()}"


def check_outputs(outs, params: list[SamplingParams], reference) -> None:
    refs = reference([o.prompt_token_ids + o.token_ids for o in outs])
    for out, p, ref in zip(outs, params, refs):
        prompt, gen = out.prompt_token_ids, out.token_ids
        if p.logprobs is None:
            assert out.logprobs is None
        else:
            assert len(out.logprobs) == len(gen)
            for j, (t, entry) in enumerate(zip(gen, out.logprobs)):
                check_entry(entry, t, ref[len(prompt) - 1 + j], p.logprobs, f"request {out.index} token {j}")
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
            for i in range(1, len(prompt)):
                check_entry(out.prompt_logprobs[i], prompt[i], ref[i - 1], p.prompt_logprobs,
                            f"request {out.index} prompt token {i}")


SHARED = tokens(8, 100)  # two full pages of 4
PROMPTS = [SHARED + tokens(3, 1), tokens(7, 2), SHARED + tokens(2, 3), tokens(1, 4), tokens(4, 5)]
PARAMS = [
    SamplingParams(max_tokens=4, ignore_eos=True, logprobs=5, prompt_logprobs=3),
    SamplingParams(max_tokens=4, temperature=0.8, top_k=10, top_p=0.9, seed=11, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0),  # hits SHARED: recomputed
    SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0, prompt_logprobs=MAX_LOGPROBS),  # 1-token prompt
    SamplingParams(max_tokens=4, ignore_eos=True),  # asks for none
]
ENGINE = dict(page_size=4, num_blocks=64, max_num_batched_tokens=8)  # 8 tokens a step: chunked prefill


def warm(llm: LLM) -> LLM:
    """Leave SHARED's pages in the prefix cache."""
    llm.generate([SHARED + [7]], SamplingParams(max_tokens=1))
    return llm


@pytest.fixture(scope="module")
def generated():
    return warm(engine(**ENGINE)).generate(PROMPTS, PARAMS)


def test_logprobs_equal_log_softmax_of_the_reference(generated, reference):
    """Chunked prefill, prefix hits of a request asking for prompt logprobs, seeded sampling (values
    before temperature and filtering), k = 0 and the largest k; the tokens equal those of the same
    requests without logprobs."""
    assert all(o.finish_reason == "length" for o in generated)
    check_outputs(generated, PARAMS, reference)
    assert generated[2].num_cached_tokens == 0  # its prompt was computed whole (for its logprobs)
    assert len(generated[3].logprobs[0]) == 1  # k = 0: the sampled token's entry only
    plain = warm(engine(**ENGINE)).generate(
        PROMPTS, [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                 seed=p.seed, ignore_eos=True) for p in PARAMS])
    assert [o.token_ids for o in generated] == [o.token_ids for o in plain]
    assert plain[2].num_cached_tokens == 8


def test_streamed_entries_equal_the_final_output(generated):
    """``new_logprobs`` aligned with ``new_token_ids`` step by step, the cumulative ``logprobs``,
    and ``prompt_logprobs`` in the first output only; equal to ``generate``'s on a twin engine."""
    llm = warm(engine(**ENGINE))
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    streamed = {i: [] for i in ids}
    prompt_entries = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if PARAMS[ids.index(out.request_id)].logprobs is None:
                assert out.new_logprobs is None and out.logprobs is None
            else:
                assert len(out.new_logprobs) == len(out.new_token_ids)
                streamed[out.request_id] += out.new_logprobs
                assert out.logprobs == streamed[out.request_id]
            if out.request_id in prompt_entries:
                assert out.prompt_logprobs is None
            else:
                prompt_entries[out.request_id] = out.prompt_logprobs
    for i, out in zip(ids, generated):
        assert streamed[i] == (out.logprobs or [])
        assert prompt_entries[i] == out.prompt_logprobs


def test_one_token_chunks_in_decode_steps_and_shared_pages_not_written(reference):
    """A budget of 2 tokens a step: the second request's prompt goes one token a step next to the first
    one's decode row (decode-only steps, the decode path's logits), over pages it hit in the prefix
    cache, which must stay as they were (made different here from what a recompute would write)."""
    llm = warm(engine(page_size=4, num_blocks=32, max_num_batched_tokens=2))
    prompt = SHARED + tokens(2, 7)
    table, cached = llm.block_manager.allocate("probe", prompt)  # the pages SHARED hit, then given back
    llm.block_manager.free("probe")
    assert cached == 8
    page = table[1]  # the first page stays clean, so that its positions' entries can be checked
    kv = llm.kv_cache.kv
    poisoned = kv[:, :, page] * 1.5  # what the cache holds from here on; a write would change it back
    kv[:, :, page] = poisoned
    params = [SamplingParams(max_tokens=7, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=4)]
    outs = llm.generate([tokens(2, 8), prompt], params)
    assert torch.equal(kv[:, :, page], poisoned), "a page shared from the prefix cache was written"
    check_outputs(outs[:1], params[:1], reference)
    # the recomputed positions read the cached K/V: those of the clean first page give prompt tokens
    # 1..4 the reference's entries; the others have the right shape
    ref = reference([prompt])[0]
    for i in range(1, 5):
        check_entry(outs[1].prompt_logprobs[i], prompt[i], ref[i - 1], 4, f"prompt token {i}")
    assert len(outs[1].prompt_logprobs) == len(prompt) and all(len(e) in (4, 5) for e in outs[1].prompt_logprobs[1:])


def test_preemption_keeps_every_entry(reference):
    """A pool too small for the four requests together: preempted requests recompute, and their
    entries are neither lost nor doubled."""
    prompts = [tokens(n, 20 + n) for n in (6, 7, 5, 8)]
    params = [SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)] * 4
    llm = engine(page_size=4, num_blocks=4, max_num_batched_tokens=32)  # each alone fits in 3 pages
    outs = llm.generate(prompts, params)
    assert llm.last_stats["preemptions"] > 0
    check_outputs(outs, params, reference)


def test_no_logprob_work_without_rows_asking(monkeypatch):
    """Without rows asking, no step gathers logprobs and greedy decode runs ahead; a request asking
    for logprobs makes its steps synchronous (nothing launched ahead while it decodes alone), one
    asking for prompt logprobs only runs ahead once they are computed."""
    llm = engine(page_size=4, num_blocks=64)
    monkeypatch.setattr(logprobs_mod, "gather", lambda *a: pytest.fail("logprobs gathered for a step without them"))
    ahead = []
    launch_ahead = llm.runner.launch_ahead
    monkeypatch.setattr(llm.runner, "launch_ahead", lambda batch: ahead.append(batch) or launch_ahead(batch))
    out = llm.generate([tokens(3, 30)], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.logprobs is None and out.prompt_logprobs is None and ahead
    monkeypatch.undo()
    ahead.clear()
    monkeypatch.setattr(llm.runner, "launch_ahead", lambda batch: ahead.append(batch) or launch_ahead(batch))
    again = llm.generate([tokens(3, 30)], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1))[0]
    assert again.token_ids == out.token_ids and len(again.logprobs) == 6 and not ahead
    prompt_only = llm.generate([tokens(3, 30)], SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=1))[0]
    assert prompt_only.token_ids == out.token_ids and len(prompt_only.prompt_logprobs) == 3
    assert ahead, "decode steps after the prompt's entries did not run ahead"


@pytest.mark.parametrize("kwargs, field", [
    (dict(logprobs=-1), "logprobs"), (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"), (dict(logprobs=1.0), "logprobs"),
    (dict(logprobs=True), "logprobs"), (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(prompt_logprobs="3"), "prompt_logprobs"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_k_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be None or an int in \[0, {MAX_LOGPROBS}\].*got"):
        SamplingParams(**kwargs)
    params = SamplingParams()
    for name, value in kwargs.items():
        setattr(params, name, value)  # changed after construction: add_request checks again
    llm = engine(page_size=4, num_blocks=8)
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        llm.add_request([5, 6], params)
    assert llm.generate([[5, 6]], params)[0].error.startswith(field)


@pytest.mark.timeout(300, method="thread")
@pytest.mark.skipif(ON_GPU and not TWO_GPUS, reason="needs 2 GPUs (without a GPU: gloo on the CPU)")
def test_two_ranks_give_one_ranks_entries(monkeypatch):
    """Tensor parallelism: the logits are gathered on every rank and rank 0 computes the entries; the
    prompt positions' LM head in slices of 2 rows (set on rank 0 only: the plan carries it, so every
    rank gathers the same slices)."""
    monkeypatch.setattr(logprobs_mod, "ROWS_PER_GATHER", 2)
    config = {**TINY_LLAMA, "num_hidden_layers": 1}
    kwargs = dict(device="cuda" if ON_GPU else "cpu", dtype=torch.float32, page_size=4, num_blocks=16)
    prompts = [tokens(6, 40), tokens(3, 41)]
    params = [SamplingParams(max_tokens=3, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=3, temperature=1.0, seed=5, ignore_eos=True, logprobs=0)]
    with LLM(config, **kwargs) as llm:
        ref = llm.generate(prompts, params)
    with LLM(config, tensor_parallel_size=2, **kwargs) as llm:
        outs = llm.generate(prompts, params)
    for got, want in zip(outs, ref):
        assert got.token_ids == want.token_ids
        for name in ("logprobs", "prompt_logprobs"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None) and len(a or []) == len(b or [])
            for x, y in zip(a or [], b or []):
                assert (x is None and y is None) or (
                    list(x) == list(y) and all(abs(x[t] - y[t]) <= ATOL for t in x)), f"{name}: {x} vs {y}"


def test_unread_gather_asks_for_every_slice_and_computes_nothing(monkeypatch):
    """A tensor-parallel worker's prompt entries are never read: it still asks for each slice's
    logits (a gather over the ranks) in rank 0's slices, and computes no log-softmax."""
    asked = []
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: pytest.fail("log_softmax on an unread gather"))
    out = logprobs_mod.gather(lambda idx: asked.append(idx.tolist()) or torch.zeros(len(idx), 8), [0, 1, 2, 3, 4],
                              torch.zeros(5, dtype=torch.int64), k=2, slice_rows=2, read=False)
    assert out is None and asked == [[0, 1], [2, 3], [4]]

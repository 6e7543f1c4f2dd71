"""The sampler's logit adjustments: ``logit_bias``, repetition / frequency / presence penalties and
``min_p``, against transformers' logits processors and a loop over the tokens (fp32, tiny random
models; on a GPU the engine runs compiled, with CUDA graphs and run-ahead).

Greedy requests with an adjustment take the argmax of the adjusted logits, so the engine's greedy
tokens must equal transformers' greedy loop with the same processors, through chunked prefill,
preemption, prefix-cache hits and run-ahead steps beside plain greedy rows.
"""

import pytest
import torch
from helpers import hf_greedy, prompts_of
from test_engine import fp32_llm, save_tiny

from pagedflash.engine import SamplingParams
from pagedflash.engine.sampling import TokenHistory, _adjust, _probabilities, sample

transformers = pytest.importorskip("transformers")
VOCAB = 128


class FrequencyPresence:
    """OpenAI's penalties over the generated tokens (those after the prompt), one token at a time."""

    def __init__(self, num_prompt, frequency, presence):
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, ids, scores):
        scores = scores.clone()
        out = ids[0, self.num_prompt:].tolist()
        for t in set(out):
            scores[0, t] -= self.frequency * out.count(t) + self.presence
        return scores


class Bias:
    def __init__(self, bias):
        self.bias = bias

    def __call__(self, ids, scores):
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[0, t] += b
        return scores


def processors(num_prompt, logit_bias=None, repetition=1.0, frequency=0.0, presence=0.0):
    """vLLM's order: the bias, the repetition penalty, then frequency and presence."""
    procs = transformers.LogitsProcessorList()
    if logit_bias:
        procs.append(Bias(logit_bias))
    if repetition != 1.0:
        procs.append(transformers.RepetitionPenaltyLogitsProcessor(repetition))
    if frequency or presence:
        procs.append(FrequencyPresence(num_prompt, frequency, presence))
    return procs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_sampling")
    return path, save_tiny(path, "llama", seed=4)


@pytest.mark.parametrize("kwargs", [
    dict(logit_bias={3: 2.5, 70: -1.0}), dict(repetition_penalty=1.7), dict(repetition_penalty=0.6),
    dict(frequency_penalty=0.7, presence_penalty=-0.4), dict(frequency_penalty=-1.5),
    dict(logit_bias={5: 1.0}, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5),
], ids=lambda kw: "+".join(kw))
def test_adjust_matches_transformers_processors(kwargs):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=g) * 3
    tokens = torch.randint(0, VOCAB, (23,), generator=g).tolist()
    num_prompt = 9
    p = SamplingParams(**kwargs)
    want = processors(num_prompt, kwargs.get("logit_bias"), kwargs.get("repetition_penalty", 1.0),
                      kwargs.get("frequency_penalty", 0.0), kwargs.get("presence_penalty", 0.0))(
        torch.tensor([tokens]), logits[None].clone())[0]
    torch.testing.assert_close(_adjust(logits[None], [p], [TokenHistory(tokens, num_prompt)])[0], want, rtol=0, atol=1e-6)
    assert p.adjusts_logits and not p.raw_greedy


def test_token_history_copies_only_new_tokens():
    """The device copy follows the list the engine appends to, growing by doubling."""
    tokens = list(range(62))
    history = TokenHistory(tokens, 10)
    assert history.device_ids("cpu").tolist() == tokens
    first = history._ids
    tokens += [5, 6, 7]  # past the first capacity (64)
    assert history.device_ids("cpu").tolist() == tokens and history._ids.shape[0] == 128
    tokens.append(9)
    again = history._ids
    assert history.device_ids("cpu").tolist() == tokens and history._ids is again is not first


def test_adjusted_rows_do_not_depend_on_each_other():
    """Rows of different params adjusted together equal each row adjusted alone, bit for bit."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(logit_bias={3: 4.0}),
              SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), SamplingParams(),
              SamplingParams(logit_bias={9: -2.0}, repetition_penalty=0.8, presence_penalty=-1.0)]
    histories = [TokenHistory(torch.randint(0, VOCAB, (n,), generator=g).tolist(), n // 2) for n in (9, 1, 30, 4, 17)]
    together = _adjust(logits, params, histories)
    for j in range(5):
        assert torch.equal(together[j], _adjust(logits[j : j + 1], params[j : j + 1], histories[j : j + 1])[0])


def _filter_ref(logits, min_p, top_k, top_p):
    """One row: min_p, then top-k (ties kept), then the smallest top-p prefix, on the vocabulary's order."""
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)  # ties: the lower id first
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits.softmax(-1)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_matches_transformers(min_p):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    got = _probabilities(logits[None], [SamplingParams(temperature=1.0, min_p=min_p)])[0]
    kept = logits if min_p == 0 else transformers.MinPLogitsWarper(min_p)(None, logits[None])[0]
    torch.testing.assert_close(got, kept.softmax(-1), rtol=1e-6, atol=1e-7)
    assert SamplingParams(min_p=min_p).raw_greedy  # min_p never changes the argmax


def test_filters_batched_equal_each_row_alone():
    """Rows of different min_p / top-k / top-p (ties in the logits included) filtered together give
    each row's distribution alone; the same zeros, probabilities within rounding."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(6, VOCAB, generator=g) * 2).round(decimals=1)  # ties
    params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, top_p=0.7),
              SamplingParams(temperature=1.0, min_p=0.1, top_k=20, top_p=0.9), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=VOCAB + 3, top_p=0.2), SamplingParams(temperature=1.0, min_p=0.5)]
    got = _probabilities(logits, params)
    for j, p in enumerate(params):
        want = _filter_ref(logits[j], p.min_p, p.top_k, p.top_p)
        assert torch.equal(got[j] > 0, want > 0), j
        torch.testing.assert_close(got[j], want, rtol=1e-5, atol=1e-7)


def test_a_row_without_filters_is_untouched_by_its_neighbours_filters():
    """A row with no min_p / top-k / top-p (a cumulative sum reaching 1.0 before its last term must
    not trim it) gets the same bits beside filtering rows as alone, and so does a filtering row."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 152064, generator=g) * 4
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01),
              SamplingParams(temperature=1.0, top_k=7)]
    together = _probabilities(logits, params)
    for j in range(3):
        alone = _probabilities(logits[j : j + 1], params[j : j + 1])[0]
        assert torch.equal(together[j], alone), j
    assert (together[0] > 0).all()


def test_draws_follow_the_distribution_and_seeded_rows_their_generator():
    """The exponential race draws each token with its probability (20,000 draws over 6 tokens), and a
    row with a generator draws the same tokens whatever rows surround it."""
    probs = torch.tensor([0.05, 0.3, 0.0, 0.4, 0.15, 0.1])
    logits = probs.log().repeat(20000, 1)
    params = [SamplingParams(temperature=1.0)] * 20000
    tokens = sample(logits, params, [None] * 20000, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=6) / 20000
    assert freq[2] == 0 and (freq - probs).abs().max() < 0.015
    seeded = SamplingParams(temperature=0.9, top_p=0.8, seed=5)
    x = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    others = SamplingParams(temperature=1.0, top_k=3)

    def draws(batched):
        gen, shared = torch.Generator().manual_seed(5), torch.Generator().manual_seed(1)
        if not batched:
            return [int(sample(x[2:3], [seeded], [gen], shared)[0]) for _ in range(12)]
        return [int(sample(x, [others, others, seeded, others], [None, None, gen, None], shared)[2]) for _ in range(12)]

    alone = draws(False)
    assert draws(True) == alone and len(set(alone)) > 1
    plain = SamplingParams(temperature=1.0, seed=5)  # no filter, beside rows that filter
    gens = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)]
    for _ in range(6):
        a = sample(x[2:3], [plain], gens[:1], None)[0]
        b = sample(x[1:3], [SamplingParams(temperature=0.6, top_p=0.5), plain], [None, gens[1]],
                   torch.Generator().manual_seed(1))[1]
        assert a == b


@pytest.mark.parametrize("kwargs, ahead", [
    (dict(repetition_penalty=1.8), False), (dict(frequency_penalty=1.2, presence_penalty=0.6), True),
    (dict(logit_bias={7: 3.0, 11: 2.0}, repetition_penalty=1.4), True),
], ids=lambda v: "+".join(v) if isinstance(v, dict) else f"ahead_{v}")
def test_greedy_with_adjustments_equals_transformers(llama, kwargs, ahead):
    """Through chunked prefill (8-token chunks), preemption (a pool too small for all rows), prefix
    hits (the prompts share a prefix) and a plain greedy row beside the adjusted ones, with run-ahead
    steps (which the plain row takes while the adjusted rows are done) or without."""
    path, hf = llama
    system = prompts_of([11], seed=20)[0]
    prompts = [system + s for s in prompts_of([5, 14, 3], seed=21)]
    n = 14
    refs = [hf_greedy(hf, q, n, processors(len(q), **_ref_kwargs(kwargs))) for q in prompts]
    plain = hf_greedy(hf, prompts[0], n + 6)
    adjusted = SamplingParams(max_tokens=n, ignore_eos=True, **kwargs)
    llm = fp32_llm(path, page_size=4, num_blocks=20, max_num_batched_tokens=8)
    llm.run_ahead.enabled = ahead
    outs = llm.generate(prompts + [prompts[0]], [adjusted] * 3 + [SamplingParams(max_tokens=n + 6, ignore_eos=True)])
    assert [o.token_ids for o in outs] == refs + [plain]
    assert sum(o.num_preemptions for o in outs) > 0 and llm.block_manager.num_free_blocks == 20
    assert refs[0] != plain[:n]  # the adjustment mattered


def _ref_kwargs(kwargs):
    return dict(logit_bias=kwargs.get("logit_bias"), repetition=kwargs.get("repetition_penalty", 1.0),
                frequency=kwargs.get("frequency_penalty", 0.0), presence=kwargs.get("presence_penalty", 0.0))


def test_logit_bias_steers_and_logprobs_stay_raw(llama):
    """A +100 bias makes every greedy token the biased one; logprobs are those of the raw logits
    (vLLM's default), so the biased token's logprob is what it would be without the bias."""
    path, _ = llama
    llm = fp32_llm(path, page_size=8, num_blocks=32)
    prompt = prompts_of([10], seed=5)[0]
    plain, biased = llm.generate([prompt] * 2, [SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0),
                                                SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3,
                                                               logit_bias={42: 100.0})])
    assert biased.token_ids == [42] * 4 and plain.token_ids != [42] * 4
    first = biased.logprobs[0]
    assert 42 in first and first[42] < max(first.values())  # the raw logits rank another token first
    assert plain.logprobs[0][plain.token_ids[0]] == max(first.values())


def test_sampled_rows_with_penalties_are_seeded_and_batch_independent(llama):
    """Seeded sampled requests, one with penalties, min_p and top-k, one with no filter at all, give
    the same tokens alone and in a batch beside rows that filter otherwise (top-p); a strong
    frequency penalty keeps the first from repeating any token."""
    path, _ = llama
    llm = fp32_llm(path, page_size=8, num_blocks=64)
    prompt = prompts_of([12], seed=6)[0]
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=9, min_p=0.02, top_k=40, frequency_penalty=2.0,
                            presence_penalty=2.0, repetition_penalty=1.2, ignore_eos=True)
    free = SamplingParams(max_tokens=12, temperature=0.7, seed=9, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate([prompt], params) + llm.generate([prompt], free)]
    batched = llm.generate(prompts_of([7, 19, 4], seed=8) + [prompt, prompt],
                           [SamplingParams(max_tokens=5, temperature=1.0, top_p=0.8, ignore_eos=True)] * 3
                           + [params, free])[3:]
    assert [o.token_ids for o in batched] == alone
    assert len(set(alone[0])) >= len(set(alone[1]))


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"1": 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(presence_penalty=True), "presence_penalty"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_adjustment_params_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_fails_alone(llama):
    """The id is checked per request (a GPU would fault on it inside the step): that request fails,
    the others run; ``add_request`` raises. The request keeps the bias it was checked with."""
    path, hf = llama
    llm = fp32_llm(path, page_size=8, num_blocks=32)
    prompt = prompts_of([6], seed=2)[0]
    bias = {VOCAB: 1.0}
    bad, good = llm.generate([prompt] * 2, [SamplingParams(max_tokens=2, logit_bias=bias),
                                           SamplingParams(max_tokens=3, ignore_eos=True)])
    assert f"logit_bias: token id {VOCAB} is outside the vocabulary" in bad.error and bad.token_ids == []
    assert good.token_ids == hf_greedy(hf, prompt, 3)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.add_request(prompt, SamplingParams(max_tokens=2, logit_bias=bias))
    params = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={9: 100.0})
    llm.add_request(prompt, params)
    params.logit_bias[9] = -100.0  # changed after the request was added: the request keeps +100
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()
    assert outs[-1].token_ids == [9, 9, 9]
    assert llm.block_manager.num_free_blocks == 32 and not llm.scheduler.running


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sample_never_syncs():
    """The batched sampler (biases, penalties, every filter, seeded and unseeded draws, a lone row and
    a chunk past 64) issues no call that waits for the device."""
    g = torch.Generator().manual_seed(7)
    dev = torch.device("cuda")
    logits = torch.randn(70, 1000, generator=g).to(dev, torch.bfloat16)
    history = [TokenHistory(torch.randint(0, 1000, (40,), generator=g).tolist(), 20) for _ in range(70)]
    kinds = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.2,
                            frequency_penalty=0.3, presence_penalty=0.2, logit_bias={5: 3.0}),
             SamplingParams(temperature=1.0), SamplingParams(logit_bias={7: 100.0}), SamplingParams()]
    params = [kinds[i % 4] for i in range(70)]
    gens = [torch.Generator(device=dev).manual_seed(i) if i % 3 == 0 else None for i in range(70)]
    for rows in (1, 70):
        sample(logits[:rows], params[:rows], gens[:rows], None, history=history[:rows])  # warm up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = sample(logits[:rows], params[:rows], gens[:rows], None, history=history[:rows])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert tokens.shape == (rows,) and tokens.device.type == "cuda"
    assert int(tokens[2]) == 7  # the +100 bias wins its greedy row

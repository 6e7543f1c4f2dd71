"""The serving engine against transformers, on tiny random models saved to a temp dir (fp32).

Greedy tokens of ``LLM.generate`` must equal a step-by-step greedy loop in transformers (a full
forward per token) with prefix caching on and off, chunked prefill, mixed batches and preemption.
On a GPU (``@pytest.mark.gpu``): bf16 logits of a 1B-class model close to transformers' SDPA, and CUDA
graph decode equal to eager decode.
"""

import pytest
import torch
from helpers import hf_greedy, prompts_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedflash.engine import LLM, GenerationOutput, SamplingParams

transformers = pytest.importorskip("transformers")
ON_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


def save_tiny(path, kind="llama", seed=0, **overrides):
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    cfg = cfg_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # biases are zero-initialized: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, save_tiny(path, "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    return path, save_tiny(path, "qwen2", seed=1, tie_word_embeddings=True)


GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def fp32_llm(model, **kwargs):
    """The engine in fp32 (on a GPU these tests run there, compiled, with CUDA graphs)."""
    return LLM(model, dtype=torch.float32, **kwargs)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_on", "prefix_off"])
def test_greedy_matches_transformers(llama, prefix_caching):
    path, hf = llama
    shared = prompts_of([40], seed=7)[0]
    prompts = prompts_of([5, 23, 1, 37]) + [shared + [3, 4], shared + [5]]
    llm = fp32_llm(path, page_size=8, num_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length" and o.error is None
        assert o.token_ids == hf_greedy(hf, p, 6), f"prompt of {len(p)} tokens"
    # a second round hits the pages the first one left behind
    again = llm.generate([shared + [9, 9, 9]], GREEDY)[0]
    assert again.token_ids == hf_greedy(hf, shared + [9, 9, 9], 6)
    assert (again.num_cached_tokens > 0) == prefix_caching


def test_qwen2_bias_and_tied_embeddings(qwen2):
    path, hf = qwen2
    prompts = prompts_of([9, 30, 4], seed=3)
    outs = fp32_llm(path, page_size=16, num_blocks=32).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_preemption_recomputes_and_completes(llama):
    path, hf = llama
    prompts = prompts_of([12, 14, 10, 15], seed=5)
    # 4 pages of 8 slots: each request alone fits (<= 3 pages), all four together cannot
    llm = fp32_llm(path, page_size=8, num_blocks=4, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert llm.last_stats["preemptions"] > 0
    assert sum(o.num_preemptions for o in outs) == llm.last_stats["preemptions"]
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 8)


def test_prefix_cache_hit_rate(llama):
    path, hf = llama
    system = prompts_of([48], seed=11)[0]
    prompts = [system + s for s in prompts_of([3, 5, 4], seed=12)]
    llm = fp32_llm(path, page_size=8, num_blocks=64, max_num_batched_tokens=20)  # the system prompt takes 3 steps
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 48, 48]
    outs = llm.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens == 48 for o in outs)
    assert llm.last_stats["prefix_cache_hit_rate"] > 0.8


def test_preempted_prefill_resumes_from_its_computed_pages(llama):
    """B is preempted mid-prefill with all five prompt pages allocated and the first two computed.
    Only those two joined the prefix cache (pages join it after the forward that wrote them), so
    they are what B hits when it comes back; it computes the rest."""
    path, hf = llama
    a, b = prompts_of([6, 40], seed=13)
    llm = fp32_llm(path, page_size=8, num_blocks=6, max_num_batched_tokens=8)
    outs = llm.generate([a, b], [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)])
    assert outs[1].num_preemptions == 1
    assert llm.block_manager.stats.hit_tokens == 16  # pages 0-1 on B's return; 2-4 were never computed
    assert llm.last_stats["computed_prefill_tokens"] == 6 + 16 + (40 - 16)
    assert outs[0].token_ids == hf_greedy(hf, a, 12)
    assert outs[1].token_ids == hf_greedy(hf, b, 3)


def test_bad_requests_fail_alone(llama):
    path, hf = llama
    llm = fp32_llm(path, page_size=8, num_blocks=8)
    good = prompts_of([6], seed=2)[0]
    bad_params, no_tokens, bad_seed = (SamplingParams(max_tokens=2) for _ in range(3))
    bad_params.top_p = 2.0  # mutated after construction: caught per request
    no_tokens.max_tokens = 0
    bad_seed.seed = 2**64  # beyond torch.Generator: used to raise out of generate for every request
    prompts = [[], good, list(range(100)) * 3, [5, 500], "text without a tokenizer", good, good, good, good,
               [1, 2.0]]
    params = [GREEDY, GREEDY, GREEDY, GREEDY, GREEDY, bad_params, SamplingParams(max_tokens=200), no_tokens, bad_seed,
              GREEDY]
    outs = llm.generate(prompts, params)
    assert all(isinstance(o, GenerationOutput) for o in outs)
    errors = [o.error for o in outs]
    assert "empty" in errors[0]
    assert outs[1].finish_reason == "length" and outs[1].token_ids == hf_greedy(hf, good, 6)
    assert "maximum length 256" in errors[2]
    assert "500" in errors[3] and "vocabulary" in errors[3]
    assert "tokenizer" in errors[4]
    assert "top_p" in errors[5]
    assert "never fit" in errors[6]
    assert "max_tokens" in errors[7] and "seed" in errors[8] and "float" in errors[9]
    assert all(o.finish_reason == "error" and o.token_ids == [] for i, o in enumerate(outs) if i != 1)


@pytest.mark.parametrize("seed", range(0, 400, 40), ids=lambda s: f"seeds{s}")
def test_scheduler_against_a_simulated_pool(seed):
    """Scheduler + block manager alone, random pools, budgets, shared prefixes and lengths: each step
    "writes" every fed position's slot with its prefix and checks that every position a row attends
    holds its own prefix (so a trusted prefix hit, a preemption or a chunk boundary that went wrong
    shows); outputs must equal an unconstrained run's, every page must come back."""
    import random

    from pagedflash.cache import BlockManager, slot_mapping
    from pagedflash.engine.scheduler import Scheduler
    from pagedflash.engine.sequence import Sequence

    for rng in (random.Random(s) for s in range(seed, seed + 40)):
        p, num_blocks, max_len = rng.choice([1, 2, 4, 8]), rng.randint(4, 24), rng.randint(4, 100)
        bm = BlockManager(num_blocks, p, enable_prefix_caching=rng.random() < 0.8)
        sched = Scheduler(bm, max_num_seqs=rng.randint(1, 8), max_num_batched_tokens=rng.randint(1, 40))
        shared, seqs, pool = [rng.randrange(5) for _ in range(rng.randint(0, 3 * p))], [], {}
        for i in range(rng.randint(1, 10)):
            prompt = shared * (rng.random() < 0.6) + [rng.randrange(5) for _ in range(rng.randint(1, 3 * p))]
            params = SamplingParams(max_tokens=rng.randint(1, 3 * p), ignore_eos=True)
            if len(prompt) <= max_len and -(-min(len(prompt) + params.max_tokens - 1, max_len) // p) <= num_blocks:
                seqs.append(Sequence(i, prompt, params, 0.0, "cpu"))
                sched.add(seqs[-1])
        next_token = lambda ids: hash(tuple(ids)) % 5
        while sched.has_unfinished():
            batch = sched.schedule()
            assert batch.num_tokens <= sched.max_num_batched_tokens and len(sched.running) <= sched.max_num_seqs
            prefixes = [[tuple(r.seq.token_ids[: i + 1]) for i in range(r.end)] for r in batch.rows]
            slots = [slot_mapping(r.seq.block_table, 0, r.end, page_size=p) for r in batch.rows]
            for row, pre, sl in zip(batch.rows, prefixes, slots):  # every layer writes before any row attends
                pool.update(zip(sl[row.start :], pre[row.start :]))
            for pre, sl in zip(prefixes, slots):
                assert [pool.get(x) for x in sl] == pre
            sched.postprocess(batch, [next_token(r.seq.token_ids) for r in batch.rows if r.samples], 0.0, set(), max_len)
        for seq in seqs:
            want = seq.token_ids[: seq.num_prompt_tokens]
            while len(want) - seq.num_prompt_tokens < seq.params.max_tokens and (
                    len(want) < max_len or len(want) == seq.num_prompt_tokens):
                want.append(next_token(want))
            assert seq.token_ids == want
        assert bm.num_free_blocks == num_blocks


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=None), "stop_token_ids"), (dict(temperature=1.0, seed=2**64), "seed"),
    (dict(max_tokens=1.5), "max_tokens"), (dict(top_p=float("nan")), "top_p"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_sampling_params_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_stop_and_timing(llama):
    path, hf = llama
    llm = fp32_llm(path, page_size=8, num_blocks=32)
    prompt = prompts_of([10], seed=4)[0]
    ref = hf_greedy(hf, prompt, 6)
    stop = llm.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=[ref[2]], ignore_eos=True))[0]
    assert stop.token_ids == ref[: ref.index(ref[2]) + 1] and stop.finish_reason == "stop"
    assert stop.ttft > 0 and len(stop.itl) == len(stop.token_ids) - 1 and stop.latency >= stop.ttft
    # top_k=1 is greedy; so is a temperature too small to divide by (1e-45 made the logits inf, the
    # probabilities NaN, and multinomial raised out of generate for every request)
    top1, tiny = llm.generate([prompt] * 2, [SamplingParams(max_tokens=6, temperature=0.8, top_k=1, ignore_eos=True),
                                             SamplingParams(max_tokens=6, temperature=1e-45, ignore_eos=True)])
    assert top1.token_ids == tiny.token_ids == ref
    sampled = [SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    a, b, c = llm.generate([prompt] * 3, sampled)
    assert a.token_ids == b.token_ids  # same seed, same tokens, whatever else is in the batch
    assert all(0 <= t < 128 for t in c.token_ids) and len(c.token_ids) == 6


def test_run_ahead_gives_the_synchronous_tokens(llama):
    """Decode steps launched before the previous step's tokens are read (greedy rows) end exactly as
    the synchronous loop: rows that stop on a stop id or at their length mid-run are dropped, the
    sampled row forces the synchronous path, no page stays held, prefix caching sees the real tokens;
    a step whose rows start new pages runs ahead too (their blocks reserved before the tokens)."""
    path, hf = llama
    prompts = prompts_of([3, 12, 6, 20], seed=11)
    ref = hf_greedy(hf, prompts[0], 30)
    params = [SamplingParams(max_tokens=30, stop_token_ids=[ref[17]], ignore_eos=True),  # stops mid-run
              SamplingParams(max_tokens=9, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=14, ignore_eos=True)]
    runs = {}
    for ahead in (False, True):
        llm = fp32_llm(path, page_size=4, num_blocks=64)
        llm.run_ahead.enabled = ahead
        calls = []
        launch_ahead = llm.runner.launch_ahead
        llm.runner.launch_ahead = lambda batch, calls=calls, f=launch_ahead: calls.append(
            any(r.start % 4 == 0 for r in batch.rows)) or f(batch)
        outs = llm.generate(prompts, params)
        again = llm.generate([prompts[2] + outs[2].token_ids[:8]], GREEDY)[0]  # pages written ahead, reused
        sampled = llm.generate(prompts[:2], [GREEDY, SamplingParams(max_tokens=6, temperature=1.0, seed=3)])
        runs[ahead] = [o.token_ids for o in outs] + [again.token_ids] + [o.token_ids for o in sampled]
        assert not llm.scheduler.running and llm.block_manager.num_free_blocks == 64
        assert bool(calls) == ahead and any(calls) == ahead  # some launched ahead across a page boundary
    assert runs[True] == runs[False]
    assert runs[True][0] == ref[: ref.index(ref[17]) + 1]
    assert again.num_cached_tokens >= 8


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_run_ahead_matches_synchronous_on_random_workloads(llama, data):
    """Random batches (page sizes, pools small enough to preempt, stop ids, lengths, a sampled row now
    and then): run-ahead and the synchronous loop produce the same tokens and free every page."""
    path, _ = llama
    page = data.draw(st.sampled_from([2, 4, 8]), label="page_size")
    n = data.draw(st.integers(1, 4), label="requests")
    lens = data.draw(st.lists(st.integers(1, 14), min_size=n, max_size=n), label="prompt_lens")
    prompts = prompts_of(lens, seed=data.draw(st.integers(0, 99), label="seed"))
    params = [SamplingParams(max_tokens=data.draw(st.integers(1, 12)), ignore_eos=True,
                             stop_token_ids=data.draw(st.lists(st.integers(0, 127), max_size=3)),
                             temperature=data.draw(st.sampled_from([0.0, 0.0, 0.0, 1.0])), seed=7) for _ in lens]
    need = max(-(-(l + p.max_tokens) // page) for l, p in zip(lens, params))
    blocks = data.draw(st.integers(need, need + 3 * n), label="num_blocks")  # tight pools preempt
    caching = data.draw(st.booleans(), label="prefix_caching")
    runs = {}
    for ahead in (False, True):
        llm = fp32_llm(path, page_size=page, num_blocks=blocks, enable_prefix_caching=caching)
        llm.run_ahead.enabled = ahead
        runs[ahead] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
        assert not llm.scheduler.running and llm.block_manager.num_free_blocks == blocks
    assert runs[True] == runs[False]


def test_string_prompts_with_a_tokenizer(llama, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    path, hf = llama
    llm = fp32_llm(path, page_size=8, num_blocks=16, tokenizer=tmp_path / "tokenizer.json")
    text, ids = llm.generate(["w5 w9 w17 w3", [5, 9, 17, 3]], GREEDY)
    assert text.prompt_token_ids == [5, 9, 17, 3] and text.token_ids == ids.token_ids == hf_greedy(hf, [5, 9, 17, 3], 6)
    written = text.token_ids[:-1] if text.finish_reason == "stop" else text.token_ids  # an ending stop id is not
    assert text.text == " ".join(f"w{t}" for t in written)


def test_eos_stops_unless_ignored(tmp_path):
    hf = save_tiny(tmp_path, "llama", seed=3)
    prompt = prompts_of([7], seed=8)[0]
    ref = hf_greedy(hf, prompt, 5)
    hf.config.eos_token_id = ref[1]
    hf.config.save_pretrained(tmp_path)
    llm = fp32_llm(tmp_path, page_size=8, num_blocks=16)
    out = llm.generate([prompt, prompt], [SamplingParams(max_tokens=5), SamplingParams(max_tokens=5, ignore_eos=True)])
    assert out[0].token_ids == ref[:2] and out[0].finish_reason == "stop"
    assert out[1].token_ids == ref and out[1].finish_reason == "length"


def test_mistral_sliding_window(tmp_path):
    hf = save_tiny(tmp_path, "mistral", seed=4, sliding_window=8)
    prompts = prompts_of([20, 6], seed=9)
    outs = fp32_llm(tmp_path, page_size=8, num_blocks=32).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_warmup_leaves_the_pool_untouched(llama):
    """The JIT warm-up (run at start-up on a GPU) runs forwards whose writes must go nowhere: cached
    pages that later requests hit stay exactly as they were."""
    path, hf = llama
    prompts = prompts_of([17, 9], seed=21)
    llm = fp32_llm(path, page_size=8, num_blocks=16, max_model_len=64)  # too short for the long prompts' step
    llm.generate(prompts, GREEDY)
    pools = [t.clone() for layer in llm.runner.kv_caches for t in layer]
    llm.runner.warmup(lengths=(1, 5, 32))  # the GPU's full set (to 8,192) costs minutes interpreted
    llm.runner._warm_step(5, 3, 1)  # the long prompts' step, in small: several sequences
    after = [t for layer in llm.runner.kv_caches for t in layer]
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(pools, after))
    outs = llm.generate(prompts, GREEDY)
    assert outs[0].num_cached_tokens == 16
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_warmup_chunks_stay_inside_the_step_budget_and_the_model_length(llama, monkeypatch):
    path, _ = llama
    seen = []

    def record(llm):
        seen.clear()
        monkeypatch.setattr(llm.runner, "model",
                            lambda ids, pos, meta, caches: seen.append((len(ids), meta.cu_seqlens_q.tolist())))
        return llm.runner

    # the long prompts' step (chunks of 256 rows) needs room for one chunk in the budget and the model
    record(fp32_llm(path, page_size=8, num_blocks=16, max_num_batched_tokens=24, max_model_len=64)).warmup(
        lengths=(1, 16, 32, 2048))
    assert seen == [(1, [0, 1])] * 2 + [(16, [0, 16])] * 2 + [(24, [0, 24])] * 2  # split and not, once each
    record(fp32_llm(path, page_size=8, num_blocks=16, max_num_batched_tokens=600, max_model_len=300)).warmup(
        lengths=(1,))
    assert seen == [(1, [0, 1])] * 2 + [(512, [0, 256, 512])]
    record(fp32_llm(path, page_size=8, num_blocks=16, max_num_seqs=3, max_model_len=300)).warmup(lengths=())
    assert seen == [(768, [0, 256, 512, 768])]  # the default budget allows 16 chunks, max_num_seqs 3


def test_cuda_graph_decode_buffers_under_interpreter(llama, monkeypatch):
    """The decode-graph path on CPU: capture is replaced by an eager replay of the captured body, so
    the static buffers (padded rows, incremental block-table rows, fixed num_splits and
    max_seqlen_k) run through the real kernels; with preemption and page growth on the way."""
    from pagedflash.engine import runner as runner_mod

    class EagerReplay:
        replays = 0

        def __init__(self, body):
            self.body = body

        def replay(self):
            EagerReplay.replays += 1
            self.body()

    monkeypatch.setattr(runner_mod, "capture", lambda body, pool: (EagerReplay(body), pool))
    path, hf = llama
    prompts = prompts_of([12, 14, 10, 15, 3], seed=5)
    llm = fp32_llm(path, page_size=8, num_blocks=6, max_num_batched_tokens=64, max_num_seqs=64)
    llm.runner.capture_graphs()
    assert sorted(llm.runner.graphs) == [1, 2, 4, 6]  # no more rows than pages (a decoding row owns its last)
    sizes, ahead, decode, launch_ahead = [], [], llm.runner._decode, llm.runner.launch_ahead
    monkeypatch.setattr(llm.runner, "_decode", lambda batch: sizes.append(len(batch.rows)) or decode(batch))
    monkeypatch.setattr(llm.runner, "launch_ahead", lambda batch: ahead.append(len(batch.rows)) or launch_ahead(batch))
    outs = llm.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True))
    assert EagerReplay.replays == len(sizes) + len(ahead) and len(sizes) > 5 and llm.last_stats["preemptions"] > 0
    assert {3, 5} & set(sizes + ahead), f"no padded replay among batch sizes {sizes}, {ahead}"
    assert ahead, "no step was launched ahead"
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 9) for p in prompts]
    # decode steps of more rows than the buffers hold take the general path, with the same tokens
    llm.runner._alloc_decode_buffers(2)
    llm.runner.graphs.clear()
    llm.runner.capture_graphs()
    assert sorted(llm.runner.graphs) == [1, 2]
    steps, launch, sizes[:], ahead[:] = [], llm.runner.launch, [], []
    monkeypatch.setattr(llm.runner, "launch",
                        lambda batch: steps.append(len(batch.rows) * batch.is_decode_only) or launch(batch))
    again = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert max(sizes + ahead) <= 2 and max(steps) > 2, (steps, sizes, ahead)  # steps: decode-only rows
    assert [o.token_ids for o in again] == [hf_greedy(hf, p, 4) for p in prompts]


@pytest.mark.gpu
@gpu
def test_gpu_bf16_logits_close_to_sdpa(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, rope_theta=500000.0,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to("cuda").eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(tmp_path, num_blocks=512)
    prompts = prompts_of([700, 33, 1500], seed=1, vocab=128256)
    ours = llm.prompt_logits(prompts)
    with torch.no_grad():
        for p, got in zip(prompts, ours):
            want = hf(torch.tensor([p], device="cuda")).logits[0].float()
            err = (got - want).abs().max().item()
            assert err < 0.05 * want.abs().max().item() + 0.05, f"max |diff| {err}"
            # random weights leave many near-ties among 128K logits: most, not all, argmaxes agree
            assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_decode_equals_eager(llama):
    path, hf = llama
    prompts = prompts_of([5, 40, 17, 3, 60, 9, 21], seed=6)
    kw = dict(dtype=torch.float32, page_size=16, num_blocks=64, max_num_seqs=16)
    eager = LLM(path, cuda_graphs=False, **kw).generate(prompts, GREEDY)
    graph = LLM(path, cuda_graphs=True, **kw).generate(prompts, GREEDY)
    assert [o.token_ids for o in graph] == [o.token_ids for o in eager] == [hf_greedy(hf, p, 6) for p in prompts]


def _with_kv_scales(src, dst, tensors: dict) -> str:
    """A copy of the checkpoint at ``src`` with extra (scale) tensors in a second safetensors file."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    save_file({k: torch.tensor(v, dtype=torch.float32) for k, v in tensors.items()}, f"{dst}/kv_scales.safetensors")
    return str(dst)


def test_fp8_kv_cache(llama, tmp_path):
    """kv_cache_dtype="fp8_e4m3": a quarter of the fp32 pool's bytes for the same pages, logits within
    quantization noise of the unquantized cache's, scales from vLLM's checkpoint names (per tensor or
    per KV head) or given."""
    path, hf = llama
    prompts = prompts_of([12, 5], seed=11)
    full = fp32_llm(path, num_blocks=32)
    exact = full.prompt_logits(prompts)
    fp8 = fp32_llm(path, num_blocks=32, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn and fp8.kv_cache.nbytes * 4 == full.kv_cache.nbytes
    assert fp8.kv_cache.k_scales.tolist() == [[1.0], [1.0]]
    for want, got in zip(exact, fp8.prompt_logits(prompts)):
        assert (got - want).abs().max() < 0.05 * want.abs().max()
    outs = fp8.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # decode steps over the pool
    assert all(len(o.token_ids) == 2 for o in outs)

    # ModelOpt's names for layer 0, compressed-tensors' for layer 1, vLLM's old single kv_scale aside
    names = {"model.layers.0.self_attn.k_proj.k_scale": 0.05, "model.layers.0.self_attn.v_proj.v_scale": 0.02,
             "model.layers.1.self_attn.k_scale": 0.04, "model.layers.1.self_attn.v_scale": 0.03}
    scaled = _with_kv_scales(path, tmp_path / "scaled", names)
    llm = fp32_llm(scaled, num_blocks=32, kv_cache_dtype="fp8")
    assert llm.kv_cache.k_scales.flatten().tolist() == pytest.approx([0.05, 0.04])
    assert llm.kv_cache.v_scales.flatten().tolist() == pytest.approx([0.02, 0.03])
    for want, got in zip(exact, llm.prompt_logits(prompts)):
        assert (got - want).abs().max() < 0.05 * want.abs().max()
    given = fp32_llm(scaled, num_blocks=32, kv_cache_dtype="fp8_e4m3", k_scale=[0.5, 0.25])
    assert given.kv_cache.k_scales.flatten().tolist() == [0.5, 0.25]
    assert given.kv_cache.v_scales.flatten().tolist() == pytest.approx([0.02, 0.03])
    legacy = _with_kv_scales(path, tmp_path / "legacy", {f"model.layers.{i}.self_attn.kv_scale": 0.125 for i in (0, 1)})
    llm = fp32_llm(legacy, num_blocks=32, kv_cache_dtype="fp8_e5m2")
    assert llm.kv_cache.dtype == torch.float8_e5m2 and llm.kv_cache.v_scales.flatten().tolist() == [0.125, 0.125]

    per_head = _with_kv_scales(path, tmp_path / "per_head",
                               {f"model.layers.{i}.self_attn.k_scale": [0.03, 0.06] for i in (0, 1)})
    llm = fp32_llm(per_head, num_blocks=32, kv_cache_dtype="fp8")
    assert llm.kv_cache.k_scales.flatten().tolist() == pytest.approx([0.03, 0.06] * 2)
    assert llm.kv_cache.scales(1)[0].shape == (2,) and llm.kv_cache.v_scales.tolist() == [[1.0], [1.0]]

    partial = _with_kv_scales(path, tmp_path / "partial", {"model.layers.1.self_attn.k_scale": 0.5})
    with pytest.raises(ValueError, match=r"k_scale given for some layers but not for layers \[0\]"):
        fp32_llm(partial, num_blocks=32, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        fp32_llm(path, num_blocks=32, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="k_scale, v_scale: apply to an fp8 KV cache only"):
        fp32_llm(path, num_blocks=32, k_scale=0.5)
    with pytest.raises(ValueError, match="v_scale must be a float or 2 entries"):
        fp32_llm(path, num_blocks=32, kv_cache_dtype="fp8_e4m3", v_scale=[1.0, 2.0, 3.0])


@pytest.mark.gpu
@gpu
def test_gpu_fp8_kv_cache_graphs_and_pool_size(llama):
    """fp8 KV in the compiled engine: CUDA-graph decode gives eager decode's tokens, and the pool
    sized from free memory holds twice the pages of a bf16 one."""
    path, _ = llama
    prompts = prompts_of([5, 40, 17, 3, 60, 9, 21], seed=6)
    kw = dict(dtype=torch.bfloat16, page_size=16, num_blocks=64, max_num_seqs=16, kv_cache_dtype="fp8_e4m3",
              k_scale=0.02, v_scale=0.02)
    eager = LLM(path, cuda_graphs=False, **kw).generate(prompts, GREEDY)
    graph = LLM(path, cuda_graphs=True, **kw).generate(prompts, GREEDY)
    assert [o.token_ids for o in graph] == [o.token_ids for o in eager]
    from pagedflash.cache import KVCache

    sizes = dict(num_layers=16, page_size=16, num_kv_heads=8, head_dim=128)
    budget = 10 << 30
    assert KVCache.num_blocks_for_memory(budget, **sizes, dtype=torch.float8_e4m3fn) == \
        2 * KVCache.num_blocks_for_memory(budget, **sizes, dtype=torch.bfloat16)

"""The engine's batch-invariant mode, ``LLM(batch_invariant=True)``: a request's tokens and logprobs
are bit for bit the same served alone or among other requests, whatever the chunking of its prefill
(other chunk sizes), preemption (recomputed), prefix-cache hits (keys another request computed), and
the same token's logprob computed by a prefill equals the one computed by a decode step; for a dense
model and mixture-of-experts ones (GPT-OSS, Qwen2-MoE); on two ranks (gloo without a GPU), and the
ranks' sums from three ranks.

Under the interpreter the attention dot runs through
:func:`pagedflash.testing.row_exact_interpreter_dot` (the host BLAS rounds by a row's place in a
block; a GPU's dot does not); the projections go one row at a time off the GPU.
"""

import pytest
import torch
from helpers import ON_GPU, TWO_GPUS

from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine.config import TINY_LLAMA
from pagedflash.testing import ROW_EXACT_DOT_ENV, row_exact_interpreter_dot

VOCAB = 128
MODEL = {**TINY_LLAMA, "vocab_size": VOCAB, "max_position_embeddings": 256, "initializer_range": 0.3}
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
ENGINE_DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
# other requests in the batch (64 in all on a GPU); step budget and pool (small enough to preempt)
OTHERS, STEP_TOKENS, POOL = ((3, 20, 9), 13, 9) if not ON_GPU else (tuple(range(3, 64)), 61, 40)
PREFIX = [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37]  # two 8-token pages


@pytest.fixture(autouse=True)
def exact_dot():
    with row_exact_interpreter_dot():
        yield


def engine(dtype=DTYPE, **kwargs) -> LLM:
    kwargs = {"page_size": 8, "num_blocks": 64, "batch_invariant": True, **kwargs}
    return LLM(MODEL, dtype=dtype, seed=0, **kwargs)


def prompt(n: int, seed: int, prefix=()) -> list[int]:
    tail = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return list(prefix) + tail


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 4, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 2, **kw})


def run(llm: LLM, prompts, ps):
    outs = llm.generate(prompts, ps)
    return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs]


MINE = [prompt(9, 1, PREFIX), prompt(5, 2), prompt(22, 3)]
SEEDED = params(temperature=0.9, top_p=0.95, seed=1234)
MINE_PARAMS = [params(), params(), SEEDED]


@pytest.fixture(scope="module", params=ENGINE_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def alone(request):
    """Each request served alone, by a roomy engine that prefills it in one chunk: (dtype, outputs)."""
    with row_exact_interpreter_dot():
        llm = engine(request.param, max_num_seqs=1, enable_prefix_caching=False)
        return request.param, [run(llm, [p], [sp])[0] for p, sp in zip(MINE, MINE_PARAMS)]


def test_alone_equals_batched_chunked_preempted_and_cached(alone):
    dtype, alone = alone
    others = [prompt(n, 10 + n, PREFIX if n % 2 else ()) for n in OTHERS]
    prompts = [others[0], MINE[0], others[1], MINE[1], others[2], MINE[2], *others[3:]]
    ps = [params(max_tokens=12)] * len(prompts)
    ps[1], ps[3], ps[5] = MINE_PARAMS
    # small steps (prefill in chunks of other sizes), a pool small enough to preempt, prefix hits
    llm = engine(dtype, max_num_seqs=64, enable_prefix_caching=True, max_num_batched_tokens=STEP_TOKENS,
                 num_blocks=POOL)
    llm.generate([PREFIX + [40, 41]], params(max_tokens=1))  # the prefix's pages cached by another request
    got = run(llm, prompts, ps)
    for i, want in zip([1, 3, 5], alone):
        assert got[i][0] == want[0], f"tokens of request {i}"
        assert got[i][1] == want[1], f"logprobs of request {i}"
        assert got[i][2] == want[2], f"prompt logprobs of request {i}"
    assert llm.scheduler.num_preemptions > 0


def test_prefill_and_decode_logprobs_agree(alone):
    """A generated token's logprob (decode step) equals the same token's prompt logprob when the
    prompt is the original prompt plus the generated tokens (prefill)."""
    dtype, alone = alone
    llm = engine(dtype, max_num_seqs=4, enable_prefix_caching=False)
    tokens, logprobs, _ = alone[0]
    extended = MINE[0] + tokens
    _, _, prompt_logprobs = run(llm, [extended], [params(max_tokens=1)])[0]
    tail = prompt_logprobs[len(MINE[0]):]
    assert [next(iter(e)) for e in tail] == tokens
    assert tail == logprobs


GPT_OSS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=2, initializer_range=0.3,
               architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
               sliding_window=8)


QWEN2_MOE = dict(GPT_OSS, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", num_experts=4,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48, sliding_window=None)
del QWEN2_MOE["num_local_experts"]


@pytest.mark.parametrize("model", [GPT_OSS, QWEN2_MOE], ids=["gpt_oss", "qwen2_moe"])
def test_moe_model_alone_equals_batched(model):
    """GPT-OSS (experts with biases, a router, sinks, sliding layers), Qwen2-MoE (a shared expert and
    its one-column gate): the experts' rows too."""
    mine, ps = [prompt(19, 5), prompt(6, 6)], [params(), params(max_tokens=3)]
    solo = LLM(model, dtype=DTYPE, seed=0, page_size=8, num_blocks=64, batch_invariant=True, max_num_seqs=1)
    alone = [run(solo, [p], [sp])[0] for p, sp in zip(mine, ps)]
    llm = LLM(model, dtype=DTYPE, seed=0, page_size=8, num_blocks=64, batch_invariant=True, max_num_seqs=8,
              max_num_batched_tokens=11)
    got = run(llm, [prompt(9, 7), mine[0], prompt(14, 8), mine[1]], [params(max_tokens=5), ps[0], params(), ps[1]])
    assert [got[1], got[3]] == alone


def test_refusals():
    with pytest.raises(TypeError, match="batch_invariant: expected a bool"):
        engine(batch_invariant=1)


OLMOE = dict(GPT_OSS, architectures=["OlmoeForCausalLM"], model_type="olmoe", num_experts=4, sliding_window=None)
del OLMOE["num_local_experts"]


@pytest.mark.skipif(ON_GPU and not TWO_GPUS, reason="needs 2 GPUs (without a GPU: gloo on the CPU)")
@pytest.mark.parametrize("model", [MODEL, OLMOE], ids=["llama", "olmoe"])
def test_two_ranks_alone_equals_batched(monkeypatch, model):
    """Tensor parallelism in the mode: each rank's shard in the mode, the two ranks' sums through the
    group's all-reduce (one addition an element, whatever the message); OLMoE: its q/k projection
    norms' sums of squares over the ranks, and experts."""
    monkeypatch.setenv(ROW_EXACT_DOT_ENV, "1")  # the worker's interpreter too (this process: the fixture)
    kw = dict(tensor_parallel_size=2, device="cuda" if ON_GPU else "cpu", batch_invariant=True, page_size=8,
              num_blocks=64)
    mine, ps = [prompt(9, 1, PREFIX), prompt(22, 3)], [params(), SEEDED]
    with LLM(model, dtype=DTYPE, seed=0, max_num_seqs=1, enable_prefix_caching=False, **kw) as solo:
        alone = [run(solo, [p], [sp])[0] for p, sp in zip(mine, ps)]
    kw["num_blocks"] = POOL * 2
    with LLM(model, dtype=DTYPE, seed=0, max_num_seqs=8, max_num_batched_tokens=STEP_TOKENS, **kw) as llm:
        got = run(llm, [prompt(12, 9, PREFIX), mine[0], prompt(7, 8), mine[1]], [params(), ps[0], params(), ps[1]])
    assert [got[1], got[3]] == alone


def _three_rank_sums(rank: int, init_method: str) -> None:
    import torch.distributed as dist

    from pagedflash.engine.parallel import make_collectives

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=3)
    try:  # symm_mem asked for and not used (it would need CUDA): the mode's sums do not take it
        comm = make_collectives(3, kind="symm_mem", dtype=torch.float32, device=torch.device("cpu"), invariant=True)
        for dtype in (torch.float32, torch.bfloat16):
            parts = [torch.randn(7, 33, generator=torch.Generator().manual_seed(r)).mul(10 ** r).to(dtype)
                     for r in range(3)]
            expected = ((parts[0].float() + parts[1].float()) + parts[2].float()).to(dtype)
            whole = comm.all_reduce(parts[rank].clone())
            assert torch.equal(whole, expected)
            for i in range(7):  # each row alone: the same bits
                assert torch.equal(comm.all_reduce(parts[rank][i : i + 1].clone())[0], whole[i])
    finally:
        dist.destroy_process_group()


def test_three_ranks_sum_in_rank_order(tmp_path):
    """From three ranks the mode's all-reduce gathers the parts and adds them in rank order, in fp32:
    a row's sum the same bits alone or in a larger message."""
    import torch.multiprocessing as mp

    mp.spawn(_three_rank_sums, args=(f"file://{tmp_path / 'group'}",), nprocs=3)


def test_server_option():
    pytest.importorskip("fastapi")  # the serve extra
    from pagedflash.entrypoints.openai import api_server

    llm = api_server.build_llm(api_server.parse_args(["--batch-invariant"]))
    assert llm.batch_invariant and llm.model.lm_head.batch_invariant
    assert all(layer.self_attn.batch_invariant for layer in llm.model.model.layers)
    assert not api_server.build_llm(api_server.parse_args([])).batch_invariant

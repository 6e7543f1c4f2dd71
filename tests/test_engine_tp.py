"""Tensor parallelism: ``LLM(..., tensor_parallel_size=2)`` against one rank.

Without a GPU: two processes over gloo, the tiny model in fp32 under the interpreter. The tokens
must equal one rank's (greedy, seeded and unseeded sampling) through preemption, prefix hits,
chunked prefill and run-ahead decode; a worker that dies makes ``step`` raise; no process outlives
``close``, the context manager or garbage collection; a held Ctrl-C leaves the engine usable; bad
sizes are refused before any process starts. With two GPUs (``@pytest.mark.gpu``): the same bodies
compiled over NCCL, and bf16 greedy tokens of a model with sharp logits equal to one GPU's with CUDA
graphs on, through both all-reduce paths.
"""

import gc
import json
import multiprocessing
import os
import random
import signal
import time
from functools import partial

import pytest
import torch
from helpers import ON_GPU, TWO_GPUS, needs_two_gpus

from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine.config import TINY_LLAMA, ModelConfig
from pagedflash.engine.parallel import (
    ALLREDUCE_ENV,
    ShardSizes,
    SymmMemAllReduce,
    allreduce_kind,
    check_tensor_parallel_size,
)
from pagedflash.engine.workers import WorkerError

# a hang (a collective waiting for a dead peer) fails with every thread's stack where pytest-timeout is
# installed (the GPU image has it), rather than stalling the matrix
pytestmark = pytest.mark.timeout(300, method="thread")

DEVICE = "cuda" if ON_GPU else "cpu"
two_ranks_here = pytest.mark.skipif(ON_GPU and not TWO_GPUS, reason="needs 2 GPUs (without a GPU: gloo on the CPU)")

TINY = {**TINY_LLAMA, "num_hidden_layers": 1}  # 4 heads, 2 KV heads: each rank one KV head
# small pages and pool: the workload below preempts, chunks its prefills and hits the prefix cache
ENGINE = dict(device=DEVICE, dtype=torch.float32, page_size=4, num_blocks=14, max_num_seqs=4,
              max_num_batched_tokens=24)


def workload(seed=0, vocab=512):
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(13)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(k)] for k in (2, 5)]
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (9, 17)]
    params = [SamplingParams(max_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),  # the engine's generator
              SamplingParams(max_tokens=5, temperature=0.7, top_k=20, seed=3, ignore_eos=True)]
    return prompts, params


def children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedflash-tp")]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def one_rank():
    with LLM(TINY, **ENGINE) as llm:
        outs = llm.generate(*workload())
        return outs, llm.last_stats, llm.prompt_logits([workload()[0][0]])[0]


@two_ranks_here
class TestTwoRanks:
    """One two-rank engine for these tests (a process holds one tensor-parallel engine at a time:
    it owns the process group), closed before the tests below start their own."""

    @pytest.fixture(scope="class")
    def two_ranks(self):
        with LLM(TINY, tensor_parallel_size=2, **ENGINE) as llm:
            yield llm
        assert not children()

    def test_tokens_equal_one_rank_through_preemption_and_prefix_hits(self, one_rank, two_ranks):
        ref, ref_stats, _ = one_rank
        outs = two_ranks.generate(*workload())
        stats = two_ranks.last_stats
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
        assert stats["preemptions"] == ref_stats["preemptions"] > 0
        assert stats["prefix_cache_hit_rate"] == ref_stats["prefix_cache_hit_rate"] > 0
        assert two_ranks.kv_cache.num_kv_heads == 1 and two_ranks.model.shard.num_heads == 2
        assert two_ranks.workers.stats["messages"] >= stats["steps"]

    def test_prompt_logits_equal_one_rank(self, one_rank, two_ranks):
        got = two_ranks.prompt_logits([workload()[0][0]])[0]
        torch.testing.assert_close(got.cpu(), one_rank[2].cpu(), rtol=1e-5, atol=1e-5)

    def test_interrupt_is_held_until_the_step_is_launched(self, one_rank, two_ranks, monkeypatch):
        """Ctrl-C in the middle of a step's device work: the work completes on every rank, the step
        raises KeyboardInterrupt and counts nothing, and the ranks stay in step (same logits after)."""
        runner = two_ranks.runner
        forward = runner._forward

        def interrupted(*args):
            os.kill(os.getpid(), signal.SIGINT)  # delivered at once; held until the step is launched
            return forward(*args)

        monkeypatch.setattr(runner, "_forward", interrupted)
        with pytest.raises(KeyboardInterrupt):
            two_ranks.generate(*workload())
        monkeypatch.undo()
        assert two_ranks.workers.closed is None and not two_ranks.has_unfinished_requests()
        assert two_ranks.block_manager.num_free_blocks == two_ranks.num_blocks
        got = two_ranks.prompt_logits([workload()[0][0]])[0]
        torch.testing.assert_close(got.cpu(), one_rank[2].cpu(), rtol=1e-5, atol=1e-5)


@two_ranks_here
def test_checkpoint_with_a_replicated_kv_head_and_a_worker_that_dies(tmp_path):
    """A checkpoint read slice by slice: one KV head over two ranks (replicated, as vLLM does),
    biases (the row-parallel ones added once), a vocabulary that does not split evenly: the tokens
    of one rank. Then a worker killed between steps, and one killed in the middle of a step:
    ``step`` raises WorkerError naming the rank (no hang), the engine stays closed, no process is left."""
    mqa = save_checkpoint(tmp_path, {**TINY, "num_key_value_heads": 1, "vocab_size": 511, "attention_bias": True,
                                     "mlp_bias": True})
    prompts, params = [[5, 6, 7, 8, 9, 10], [11, 12, 13]], SamplingParams(max_tokens=3, ignore_eos=True)
    with LLM(mqa, **ENGINE) as ref:
        want = [o.token_ids for o in ref.generate(prompts, params)]
    llm = LLM(mqa, tensor_parallel_size=2, **ENGINE)
    assert llm.kv_cache.num_kv_heads == 1 and llm.model.shard.kv_head_start == 0
    assert llm.model.lm_head.weight.shape[0] == 256  # rank 1 holds 255 rows and one of padding
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    (pid,) = llm.workers.pids
    os.kill(pid, signal.SIGKILL)
    llm.add_request([1, 2, 3], params)
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match="rank 1 .* died"):
        llm.step()
    assert time.perf_counter() - t0 < 30
    with pytest.raises(WorkerError, match="closed"):
        llm.step()
    for call in (partial(llm.generate, [[1, 2]], params), partial(llm.add_request, [1, 2], params),
                 partial(llm.prompt_logits, [[1, 2]]), partial(llm.abort_request, 0)):
        with pytest.raises(WorkerError, match="closed"):  # not "generate needs an idle engine"
            call()
    assert gone(pid) and not children()
    llm.close()

    llm = LLM(mqa, tensor_parallel_size=2, **ENGINE)
    (pid,) = llm.workers.pids
    forward = llm.runner._forward

    def killed_mid_step(*args):  # the worker has the step; rank 0 meets a dead peer in a collective
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        return forward(*args)

    llm.runner._forward = killed_mid_step
    with pytest.raises(WorkerError, match="rank 1"):
        llm.generate(prompts, params)
    assert gone(pid) and not children()
    del llm


@two_ranks_here
def test_no_process_outlives_the_engine(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))  # and no weights: every rank raises
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(tmp_path, tensor_parallel_size=2, **ENGINE)
    assert not children()

    with pytest.raises(ZeroDivisionError), LLM(TINY, tensor_parallel_size=2, **ENGINE) as llm:
        pids = llm.workers.pids
        assert len(pids) == 1 and not gone(pids[0])
        raise ZeroDivisionError  # an exception inside the block: __exit__ closes
    assert all(gone(p) for p in pids) and not children()
    llm.close()  # again: nothing to do

    import torch.distributed as dist

    llm = LLM(TINY, tensor_parallel_size=2, **ENGINE)
    pids = llm.workers.pids
    # CUDA graphs that captured collectives hold NCCL references a destroy waits for: they go first
    assert llm.workers.before_group_end == [llm.runner.graphs.clear]
    seen = []
    llm.workers.before_group_end.append(lambda: seen.append(dist.is_initialized()))
    del llm  # no close(): the finalizer stops the worker
    gc.collect()
    assert all(gone(p) for p in pids) and not children()
    assert seen == [True]  # released while the group still stood
    assert not dist.is_initialized()  # the group is destroyed with the engine: a new one can start


@pytest.mark.skipif(ON_GPU, reason="the GPU engine runs its own watchdog (the dead-worker test above)")
def test_the_watchdog_releases_the_graphs_then_aborts_when_a_worker_exits(monkeypatch):
    """The watchdog (started on GPUs only; here over gloo with a stand-in abort) ends the group the
    moment a worker exits: the runner's graphs released first, the group aborted, and the next step
    raises WorkerError naming the rank."""
    import torch.distributed as dist

    order = []

    def abort():
        order.append("abort")
        dist.destroy_process_group()

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", abort)
    llm = LLM(TINY, tensor_parallel_size=2, **ENGINE)
    llm.workers.before_group_end.append(lambda: order.append("graphs released"))
    llm.workers._start_watchdog()
    (pid,) = llm.workers.pids
    os.kill(pid, signal.SIGKILL)
    deadline = time.perf_counter() + 30
    while not order and time.perf_counter() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert order == ["graphs released", "abort"] and not dist.is_initialized()
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(WorkerError, match="rank 1 .* died"):
        llm.step()
    llm.close()
    assert gone(pid) and not children() and order == ["graphs released", "abort"]


@pytest.mark.skipif(ON_GPU, reason="a stand-in abort over gloo")
def test_an_abort_that_does_not_return_leaves_the_engine_closed_not_hung(monkeypatch):
    """Should the group's abort never return (the watchdog stuck inside it), the failing step still
    raises WorkerError after JOIN_S, with a warning, and leaves the group alone (the stuck thread
    holds it)."""
    import threading

    import torch.distributed as dist

    from pagedflash.engine import workers

    release = threading.Event()

    def abort():  # blocks like an NCCL abort that waits for a kernel that never ends
        release.wait(60)
        dist.destroy_process_group()

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", abort)
    monkeypatch.setattr(workers, "JOIN_S", 0.5)
    llm = LLM(TINY, tensor_parallel_size=2, **ENGINE)
    llm.workers._start_watchdog()
    (pid,) = llm.workers.pids
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)  # the watchdog is inside the abort now
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match="abort did not return"), pytest.raises(WorkerError, match="rank 1"):
        llm.step()
    assert time.perf_counter() - t0 < 10 and dist.is_initialized()
    release.set()  # the abort returns: the group goes, and a new engine could start
    deadline = time.perf_counter() + 10
    while dist.is_initialized() and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert not dist.is_initialized() and not children()


@two_ranks_here
def test_fp8_pool_with_per_head_scales_equals_one_rank():
    """kv_cache_dtype="fp8" over two ranks: each rank's pool holds its own KV head's scales, so logits
    and tokens equal one rank's fp8 engine's. The heads' value scales differ widely (the second one
    rounds values coarsely): a rank that took the other head's scale would give other logits."""
    kw = dict(kv_cache_dtype="fp8_e4m3", k_scale=[[0.02, 0.05]], v_scale=[[0.01, 4.0]])
    prompts, params = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]], SamplingParams(max_tokens=3, ignore_eos=True)
    with LLM(TINY, **kw, **ENGINE) as one:
        want = one.prompt_logits(prompts[:1])[0], [o.token_ids for o in one.generate(prompts, params)]
    with LLM(TINY, tensor_parallel_size=2, **kw, **ENGINE) as two:
        assert two.kv_cache.dtype == torch.float8_e4m3fn and torch.equal(two.kv_cache.k_scales.cpu(), torch.tensor([[0.02]]))
        got = two.prompt_logits(prompts[:1])[0], [o.token_ids for o in two.generate(prompts, params)]
    torch.testing.assert_close(got[0].cpu(), want[0].cpu(), rtol=1e-5, atol=1e-5)
    assert got[1] == want[1] and not children()


@pytest.mark.parametrize("size, match", [
    (0, "must be an int >= 1"), (-2, "must be an int >= 1"), (True, "must be an int >= 1"),
    (1.5, "must be an int >= 1"), (3, "must divide num_attention_heads=4"),
    (8, "more than the model's num_attention_heads=4"),
])
def test_bad_sizes_are_refused_before_any_process_starts(size, match):
    with pytest.raises(ValueError, match="tensor_parallel_size") as error:
        LLM(TINY, tensor_parallel_size=size, device="cpu")
    assert match in str(error.value) and not children()


def test_sizes_the_model_cannot_split():
    cpu = torch.device("cpu")
    odd_kv = ModelConfig.from_dict({**TINY, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 16})
    with pytest.raises(ValueError, match="tensor_parallel_size=6 and num_key_value_heads=4"):
        check_tensor_parallel_size(odd_kv, 6, cpu)
    odd_mlp = ModelConfig.from_dict({**TINY, "intermediate_size": 130})
    with pytest.raises(ValueError, match="must divide intermediate_size=130"):
        check_tensor_parallel_size(odd_mlp, 4, cpu)
    config = ModelConfig.from_dict(TINY)
    assert check_tensor_parallel_size(config, 4, cpu) == 4  # 2 KV heads, each on two ranks
    shards = [ShardSizes.of(config, r, 4) for r in range(4)]
    assert [s.kv_head_start for s in shards] == [0, 0, 1, 1] and {s.num_kv_heads for s in shards} == {1}
    odd_vocab = ShardSizes.of(ModelConfig.from_dict({**TINY, "vocab_size": 511}), 1, 2)
    assert (odd_vocab.vocab_start, odd_vocab.vocab_rows, odd_vocab.vocab_per_rank) == (256, 255, 256)


def test_allreduce_switch(monkeypatch):
    """PAGEDFLASH_ALLREDUCE: the group's all-reduce by default, ``symm_mem`` only on GPUs, anything
    else refused by name; the one-shot path takes contiguous messages of its dtype up to its buffer
    and hands the rest to the group's all-reduce."""
    monkeypatch.delenv(ALLREDUCE_ENV, raising=False)
    assert allreduce_kind(torch.device("cpu")) == "nccl"
    monkeypatch.setenv(ALLREDUCE_ENV, "SYMM_MEM")
    assert allreduce_kind(torch.device("cuda")) == "symm_mem"
    with pytest.raises(ValueError, match=f"{ALLREDUCE_ENV}=symm_mem needs CUDA"):
        allreduce_kind(torch.device("cpu"))
    with pytest.raises(ValueError, match=f"{ALLREDUCE_ENV}=symm_mem needs CUDA"):
        LLM(TINY, tensor_parallel_size=2, device="cpu")
    assert not children()
    monkeypatch.setenv(ALLREDUCE_ENV, "ring")
    with pytest.raises(ValueError, match=f"{ALLREDUCE_ENV} must be one of .* got 'ring'"):
        allreduce_kind(torch.device("cuda"))

    import torch.distributed as dist

    class Group:
        group_name = "tp"

    one_shot, fallback = [], []

    def fake_one_shot(buf, op, name, out):  # stands in for torch.ops.symm_mem.one_shot_all_reduce_out
        one_shot.append((op, name, buf.numel()))
        out.copy_(buf * 2)  # two ranks holding the same values

    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: fallback.append(x.numel()) or x.mul_(2))
    reduce = SymmMemAllReduce(Group(), dtype=torch.float32, device=torch.device("cpu"), max_bytes=64,
                              one_shot=fake_one_shot)
    small, large = torch.arange(6.0).view(2, 3), torch.ones(17)
    reduce(small)
    reduce(large)
    reduce(torch.ones(4, dtype=torch.float64))
    reduce(torch.ones(4, 4)[:, :2])  # not contiguous
    assert torch.equal(small, 2 * torch.arange(6.0).view(2, 3)) and torch.equal(large, torch.full((17,), 2.0))
    assert one_shot == [("sum", "tp", 6)] and fallback == [17, 4, 8]


# ---------------------------------------------------------------------------------------- two GPUs
def save_checkpoint(path, config: dict, seed=0, sharpness=1.0):
    """A random Llama saved as safetensors (transformers' init; biases drawn, not zero). ``sharpness``
    scales the LM head so that the top logit stands far above the rest: then bf16 rounding (and the
    order of the all-reduce's sums) cannot flip a greedy token."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("all_reduce", ["nccl", "symm_mem"])
def test_gpu_bf16_greedy_tokens_equal_one_gpu_with_cuda_graphs(tmp_path, monkeypatch, all_reduce):
    config = {**TINY_LLAMA, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32000,
              "max_position_embeddings": 2048}
    path = save_checkpoint(tmp_path, config, sharpness=30.0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(n)] for n in (1, 7, 100, 513, 1000, 33, 64, 2)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)  # logits gathered, sampled
    kw = dict(dtype=torch.bfloat16, cuda_graphs=True, max_num_seqs=16)
    with LLM(path, **kw) as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
        want_seeded = [o.token_ids for o in one.generate(prompts[:3], seeded)]
    monkeypatch.setenv(ALLREDUCE_ENV, all_reduce)
    with LLM(path, tensor_parallel_size=2, **kw) as two:
        assert two.runner.graphs, "decode graphs (with their all-reduces) were captured"
        assert [o.token_ids for o in two.generate(prompts, params)] == want
        assert [o.token_ids for o in two.generate(prompts[:3], seeded)] == want_seeded
    assert not children()

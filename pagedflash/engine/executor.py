"""What every rank of the engine builds: the model (with several ranks, this rank's shard of it)
filled with weights, the KV pool of its KV heads sized from free memory, and the
:class:`~pagedflash.engine.runner.ModelRunner` that runs its steps.

Rank 0 (the process of :class:`~pagedflash.engine.LLM`) and the tensor-parallel workers
(:mod:`pagedflash.engine.workers`) build it from the same :class:`EngineSpec`, in the same order:
the collectives of the memory profile, the warm-up forwards and the CUDA-graph captures pair up
across the ranks. The pool gets the same number of pages on every rank (the smallest any rank can
hold), so that page ids mean the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedflash.cache import BlockManager, KVCache
from pagedflash.engine.config import ModelConfig
from pagedflash.engine.model import CausalLM
from pagedflash.engine.parallel import Collectives, ShardSizes
from pagedflash.engine.runner import GRAPH_BATCH_SIZES, ModelRunner, graph_num_splits, graph_sizes
from pagedflash.engine.sampling import MAX_LOGPROBS, SamplingParams
from pagedflash.engine.scheduler import Batch, ScheduledRow
from pagedflash.engine.sequence import Sequence
from pagedflash.engine.weights import build_model, init_random_weights, load_weights
from pagedflash.ops.launch import (
    invariant_config,
    invariant_num_splits,
    invariant_split_programs,
    invariant_split_rule,
)
from pagedflash.ops.utils import interpreted, num_sms

CPU_NUM_BLOCKS = 512  # default pool off the GPU: 8K tokens at page 16


@dataclass(frozen=True)
class EngineSpec:
    """The engine's arguments that every rank needs (picklable: workers receive it)."""

    config: ModelConfig
    path: str | None  # local HF directory, or None for seeded random weights
    seed: int
    dtype: torch.dtype
    device: torch.device  # rank 0's; rank r runs on the GPU r places further (device_of)
    max_model_len: int
    page_size: int
    num_blocks: int | None  # None: sized from free GPU memory (a default on the CPU)
    max_num_seqs: int
    max_num_batched_tokens: int
    cuda_graphs: bool
    gpu_memory_utilization: float
    tensor_parallel_size: int = 1
    all_reduce: str = "nccl"
    kv_cache_dtype: torch.dtype | None = None  # the pool's; None: the model's dtype
    # an fp8 pool's scales of the whole model: per layer, (x,) for every KV head or one per KV head
    k_scale: tuple[tuple[float, ...], ...] | None = None
    v_scale: tuple[tuple[float, ...], ...] | None = None
    batch_invariant: bool = False  # CausalLM.make_batch_invariant before any graph is captured

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    def pool(self, shard: ShardSizes, **sizes) -> KVCache:
        """A KV pool of ``shard``'s KV heads in the spec's KV dtype, holding the scales of its heads."""
        scales = {} if self.k_scale is None else dict(k_scale=shard.own_kv_heads(self.k_scale),
                                                     v_scale=shard.own_kv_heads(self.v_scale))
        return KVCache(num_layers=self.config.num_layers, page_size=self.page_size, num_kv_heads=shard.num_kv_heads,
                       head_dim=self.config.head_dim, dtype=self.kv_dtype, **scales, **sizes)

    def device_of(self, rank: int) -> torch.device:
        """Rank ``rank``'s device: GPU ``device.index + rank`` (the LLM gives several ranks an
        explicit index), the CPU for every rank on the CPU."""
        if self.device.type != "cuda" or self.tensor_parallel_size == 1:
            return self.device
        return torch.device("cuda", self.device.index + rank)


@dataclass
class Rank:
    model: CausalLM
    kv_cache: KVCache
    runner: ModelRunner
    num_blocks: int


def build_rank(spec: EngineSpec, *, rank: int = 0, comm: Collectives | None = None,
               generator: torch.Generator | None = None, release_hooks: list | None = None) -> Rank:
    """Build rank ``rank``'s model, pool and runner (``comm``: the tensor-parallel group; None with
    one rank). ``generator``: the runner's default sampling generator (rank 0's). ``release_hooks``:
    the runner adds the release of its CUDA graphs there before it captures any."""
    config, device = spec.config, spec.device_of(rank)
    shard = ShardSizes.of(config, rank, spec.tensor_parallel_size)
    model = build_model(config, max_len=spec.max_model_len, dtype=spec.dtype, device=device, shard=shard, comm=comm)
    if spec.path is not None:
        load_weights(model, spec.path)
    else:
        init_random_weights(model, spec.seed)
    if spec.batch_invariant:
        model.make_batch_invariant()
    num_blocks = spec.num_blocks
    if num_blocks is None:
        num_blocks = auto_num_blocks(model, spec, device)
        if comm is not None and comm.size > 1:
            num_blocks = comm.min_int(num_blocks)
    kv_cache = spec.pool(shard, num_blocks=num_blocks, device=device)
    runner = ModelRunner(model, kv_cache, max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs,
                         use_cuda_graphs=spec.cuda_graphs, generator=generator, release_hooks=release_hooks,
                         max_num_batched_tokens=spec.max_num_batched_tokens)
    return Rank(model, kv_cache, runner, num_blocks)


def auto_num_blocks(model: CausalLM, spec: EngineSpec, device: torch.device) -> int:
    """Pages that fit ``spec.gpu_memory_utilization`` of the GPU next to the weights, a largest
    step's activations, its logits and logprobs included (:func:`largest_step`), and a batch-invariant
    engine's decode-graph split partials (:func:`graph_split_bytes`); :data:`CPU_NUM_BLOCKS` off the
    GPU."""
    if device.type != "cuda":
        return CPU_NUM_BLOCKS
    config = spec.config
    per_block = KVCache.bytes_per_block(num_layers=config.num_layers, page_size=spec.page_size,
                                        num_kv_heads=model.shard.num_kv_heads, head_dim=config.head_dim,
                                        dtype=spec.kv_dtype)
    peak = _profile_activations(model, spec, device) + graph_split_bytes(model, spec, num_sms(device))
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * spec.gpu_memory_utilization) - (total - free) - peak
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB); "
                           "lower max_num_batched_tokens or raise gpu_memory_utilization")
    # no more than every running sequence at full length needs (a small model on a big GPU)
    return int(min(num_blocks, spec.max_num_seqs * -(-spec.max_model_len // spec.page_size)))


@torch.inference_mode()
def _profile_activations(model: CausalLM, spec: EngineSpec, device: torch.device) -> int:
    """Peak activation bytes of a largest step (:func:`largest_step`), on a scratch pool."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    runner, batch = largest_step(model, spec, device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.run(batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del runner, batch
    torch.cuda.empty_cache()
    return int(peak * 1.1) + (256 << 20)  # margin for CUDA graphs and allocator slack


def graph_split_bytes(model: CausalLM, spec: EngineSpec, sms: int) -> int:
    """Bytes of the attention's split partials held by a batch-invariant engine's decode CUDA graphs
    (0 without the mode or without graphs), which the profiled prefill step does not allocate.

    A graph of ``bs`` rows captured with a split (:func:`~pagedflash.engine.runner.graph_num_splits`
    above 1) keeps, in the mode, one partial state per split of ``max_model_len`` keys under
    :func:`~pagedflash.ops.launch.invariant_split_rule` (none when that is one split, past the mode's
    split cap or partial-state budget for ``bs x Hq`` states a split,
    :func:`~pagedflash.ops.launch.invariant_num_splits`, or when its programs, ``bs x Hkv`` or ``bs x
    Hq`` where a KV group does not divide the mode's tile rows, leave one program a row,
    :func:`~pagedflash.ops.launch.invariant_split_programs`): fp32 partials ``[splits, bs, Hq, D]`` and
    ``[splits + 1, bs, Hq]`` per layer (``Hq``: this rank's query heads). Each graph's eager warm-up run
    leaves one such set in the scratch cache (:mod:`pagedflash.ops.scratch`, one shape for all
    layers; it keeps at most ``MAX_BUFFERS`` sets, so their sum is a bound), and its capture takes
    one set at a time in the graphs' shared pool (a layer's set is freed after its combine, before the next layer's): the sum
    over the graphs plus the largest one."""
    if not (spec.batch_invariant and spec.cuda_graphs):
        return 0
    rule, heads = invariant_split_rule(interpreted(), spec.config.head_dim), model.shard.num_heads
    # ModelRunner.max_decode_rows or more: it also caps by the pool's pages, which this sizes
    sizes = graph_sizes(min(spec.max_num_seqs, GRAPH_BATCH_SIZES[-1]))
    kv_heads = model.shard.num_kv_heads
    group = heads // kv_heads  # a decode row's programs: a KV head's query heads packed when they divide the tile
    g_pack = invariant_config(group=group, head_dim=spec.config.head_dim, capability=None,
                              interpreted=interpreted()).g_pack
    programs_a_row = kv_heads * (group // g_pack)
    sets = []  # bytes of each graph's set of partials
    for bs in sizes:
        splits = invariant_num_splits(spec.max_model_len, rule, bs * heads)
        if graph_num_splits(bs, kv_heads, sms) > 1 and invariant_split_programs(splits, bs * programs_a_row, sms) > 1:
            sets.append((splits * (spec.config.head_dim + 1) + 1) * bs * heads * 4)  # + the rows' split counts
    return sum(sets) + max(sets, default=0)


def largest_step(model: CausalLM, spec: EngineSpec, device: torch.device) -> tuple[ModelRunner, Batch]:
    """A runner on a scratch pool and the step of largest activations it can be given: the prefill
    of max_num_batched_tokens prompt tokens spread over max_num_seqs sequences, each asking for
    ``logprobs`` and ``prompt_logprobs`` of :data:`~pagedflash.engine.sampling.MAX_LOGPROBS`, and
    sampled with every filter and penalty (the sampler's temporaries, ``MAX_SAMPLE_ROWS`` rows at a
    time). Its
    logits: ``[max_num_seqs, vocab]`` for the sampling rows, and the prompt positions' in slices of
    :data:`~pagedflash.engine.logprobs.ROWS_PER_GATHER` rows, each slice's fp32 log-softmax and top
    k computed before the next slice's LM head (:mod:`pagedflash.engine.logprobs`): its logits peak is
    ``O((max_num_seqs + ROWS_PER_GATHER) x vocab)``, not ``O(max_num_batched_tokens x vocab)``."""
    page_size, max_len = spec.page_size, spec.max_model_len
    tokens = min(spec.max_num_batched_tokens, spec.max_num_seqs * max_len)
    num_seqs = min(spec.max_num_seqs, tokens)
    lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
    num_blocks = sum(-(-n // page_size) for n in lens)
    scratch = spec.pool(model.shard, num_blocks=num_blocks, device=device)
    bm = BlockManager(num_blocks, page_size, enable_prefix_caching=False)
    params = SamplingParams(logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS, temperature=1.0, top_p=0.9, top_k=50,
                            min_p=0.01, repetition_penalty=1.1, frequency_penalty=0.1, logit_bias={0: 1.0})
    seqs = [Sequence(i, [0] * n, params, 0.0, device) for i, n in enumerate(lens)]
    for seq in seqs:
        seq.block_table, _ = bm.allocate(seq.seq_id, seq.token_ids)
    runner = ModelRunner(model, scratch, max_model_len=max_len, max_num_seqs=num_seqs, use_cuda_graphs=False,
                         generator=None, max_num_batched_tokens=tokens)
    return runner, Batch([ScheduledRow(seq, 0, len(seq)) for seq in seqs])

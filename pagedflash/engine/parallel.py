"""Tensor parallelism: how the model splits over ``N`` ranks, and the collectives that join the parts.

Megatron-style, as vLLM and nano-vllm split a Llama. Rank ``r`` of ``N`` holds:

- attention: query heads ``[r Hq/N, (r+1) Hq/N)`` and the KV heads they read. When ``N`` divides
  ``Hkv`` that is ``Hkv/N`` KV heads; when ``Hkv`` divides ``N`` (more ranks than KV heads) it is one
  KV head, replicated on ``N/Hkv`` ranks (vLLM's rule). ``qkv_proj`` holds those rows of q, k and v
  (column-parallel), ``o_proj`` the matching input columns (row-parallel);
- MLP: rows ``[r I/N, (r+1) I/N)`` of gate and up (column-parallel), the same columns of down
  (row-parallel); a mixture of experts likewise within every expert (``moe_intermediate_size``: rows
  of each expert's gate and up, columns of its down; the router whole, the experts' down biases on
  rank 0; a shared expert split as a dense MLP, its gate whole), so that one all-reduce sums the
  layer as for a dense MLP;
- vocabulary: rows ``[r Vr, min((r+1) Vr, V))`` of the embedding and the LM head, ``Vr = ceil(V/N)``;
  the last rank pads its shard with zero rows to ``Vr``, so every rank's logits have one shape;
- norms and RoPE tables whole; the biases of ``o_proj``/``down_proj`` on rank 0 only (zero
  elsewhere), so that the all-reduce adds them once.

Each layer's two row-parallel outputs (``o_proj``, ``down_proj``) are summed by one all-reduce each,
the embedding (each rank looks up the ids of its rows, zeros elsewhere) by one more, and the LM
head's logits are gathered, so that every rank holds the full logits and computes the same greedy
tokens; rank 0 samples from them exactly as one GPU does.

All-reduce: the process group's (NCCL on GPUs, gloo on the CPU) by default; in the engine's
batch-invariant mode, from three ranks, an all-gather and a sum in rank order (:class:`Collectives`). ``PAGEDFLASH_ALLREDUCE=
symm_mem`` (GPU only) sends messages up to :data:`SYMM_MEM_MAX_BYTES` through torch's symmetric-memory
one-shot all-reduce (each rank reads its peers' buffers directly and sums them; no multicast), and
larger ones through the group's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedflash.validate import check_int

ALLREDUCE_ENV = "PAGEDFLASH_ALLREDUCE"
ALLREDUCE_KINDS = ("nccl", "symm_mem")  # "nccl": the group's all-reduce (gloo's on the CPU)
SYMM_MEM_MAX_BYTES = 1 << 20  # largest message of the one-shot path (decode-sized; to be tuned on GPUs)


def check_tensor_parallel_size(config, size, device: torch.device) -> int:
    """``size`` if ``config``'s model splits over that many ranks on ``device``; else ``ValueError``
    naming ``tensor_parallel_size``, the model's numbers and what would work."""
    check_int("tensor_parallel_size", size)
    if size == 1:
        return size
    heads, kv_heads, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if size > heads:
        raise ValueError(f"tensor_parallel_size={size} is more than the model's num_attention_heads={heads}: "
                         "every rank needs at least one attention head")
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={heads} "
                         f"(choose one of {[n for n in range(1, heads + 1) if heads % n == 0]})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv_heads}: one must divide the "
                         "other (KV heads are split across ranks, or replicated when there are fewer than ranks)")
    if inter % size:
        raise ValueError(f"tensor_parallel_size={size} must divide intermediate_size={inter}")
    moe_inter = getattr(config, "moe_intermediate_size", 0)
    if moe_inter % size:
        raise ValueError(f"tensor_parallel_size={size} must divide each expert's intermediate size {moe_inter}")
    shared_inter = getattr(config, "shared_expert_intermediate_size", 0)
    if shared_inter % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the shared expert's intermediate size "
                         f"{shared_inter} (shared_expert_intermediate_size)")
    if config.vocab_size <= (size - 1) * -(-config.vocab_size // size):
        raise ValueError(f"tensor_parallel_size={size} leaves a rank without vocabulary rows "
                         f"(vocab_size={config.vocab_size})")
    if device.type == "cuda":
        first = device.index or 0
        if first + size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} needs GPUs {first}..{first + size - 1} (one per rank), "
                             f"but {torch.cuda.device_count()} are visible")
    elif device.type != "cpu":
        raise ValueError(f"tensor_parallel_size={size} runs on CUDA GPUs (NCCL) or the CPU (gloo), not {device.type}")
    return size


def allreduce_kind(device: torch.device) -> str:
    """The all-reduce ``PAGEDFLASH_ALLREDUCE`` selects for ranks on ``device`` (default ``nccl``)."""
    kind = os.environ.get(ALLREDUCE_ENV, "nccl").strip().lower() or "nccl"
    if kind not in ALLREDUCE_KINDS:
        raise ValueError(f"{ALLREDUCE_ENV} must be one of {ALLREDUCE_KINDS}, got {kind!r}")
    if kind == "symm_mem" and device.type != "cuda":
        raise ValueError(f"{ALLREDUCE_ENV}=symm_mem needs CUDA devices (symmetric memory), got {device}; "
                         "unset it to use the process group's all-reduce")
    return kind


@dataclass(frozen=True)
class ShardSizes:
    """What rank ``rank`` of ``size`` holds of a model (see the module docstring)."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (its KV pool's Hkv)
    kv_head_start: int  # the first of them, in the model's numbering
    intermediate_size: int  # MLP rows on this rank
    vocab_per_rank: int  # rows of this rank's embedding / LM head shard (zero-padded on the last rank)
    vocab_size: int  # the model's
    moe_intermediate_size: int = 0  # each expert's MLP rows on this rank (0: no experts)
    shared_expert_intermediate_size: int = 0  # the shared expert's MLP rows on this rank (0: none)

    @classmethod
    def of(cls, config, rank: int = 0, size: int = 1) -> ShardSizes:
        heads, kv_heads = config.num_heads // size, max(1, config.num_kv_heads // size)
        group = config.num_heads // config.num_kv_heads  # query heads per KV head
        return cls(rank=rank, size=size, num_heads=heads, num_kv_heads=kv_heads,
                   kv_head_start=rank * heads // group, intermediate_size=config.intermediate_size // size,
                   vocab_per_rank=-(-config.vocab_size // size), vocab_size=config.vocab_size,
                   moe_intermediate_size=getattr(config, "moe_intermediate_size", 0) // size,
                   shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) // size)

    def own_kv_heads(self, per_layer):
        """This rank's part of per-layer K/V-head values (an fp8 pool's scales): of each layer's entry,
        ``[x]`` (one for every head) whole, ``[x_0 .. x_{Hkv-1}]`` (one per KV head) this rank's heads."""
        end = self.kv_head_start + self.num_kv_heads
        return tuple(tuple(row) if len(row) == 1 else tuple(row[self.kv_head_start : end]) for row in per_layer)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Real (not padding) vocabulary rows of this rank's shard."""
        return min(self.vocab_per_rank, self.vocab_size - self.vocab_start)


class Collectives:
    """The tensor-parallel group's operations. With one rank every operation is the identity and no
    process group exists (the single-GPU path runs no collective code).

    ``invariant`` (the engine's batch-invariant mode): each element's sum over the ranks has the same
    bits whatever the message it travels in. A library's all-reduce picks its algorithm by message
    size, and with it the order in which it adds three or more ranks' values; with two ranks every
    algorithm adds the two values once (``a + b == b + a``), so the group's all-reduce keeps the
    bits there (the one-shot symmetric-memory path, taken by message size, is not used: its
    zero-started fp32 sum is not shown to give the group's bits, the sign of a zero at least). From three ranks the parts are gathered and added in rank order on each rank,
    ``((x_0 + x_1) + x_2) + ...`` in fp32, rounded once to ``x``'s dtype (elementwise: no order
    depends on the message), at the cost of an all-gather (``size - 1`` parts received, where a ring
    all-reduce receives ``2 (size - 1) / size``) and ``size`` elementwise kernels."""

    def __init__(self, size: int = 1, group=None, all_reduce=None, device: torch.device | None = None,
                 invariant: bool = False):
        self.size = size
        self.group = group
        self._all_reduce = all_reduce  # a faster all-reduce (SymmMemAllReduce), or None: the group's
        self.device = device  # where the group's tensors live (the rank's GPU, or the CPU)
        self.invariant = invariant

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.size > 1:
            if self.invariant and self.size > 2:
                self._sum_in_rank_order(x)
            elif self._all_reduce is not None and not self.invariant:
                self._all_reduce(x)
            else:
                import torch.distributed as dist

                dist.all_reduce(x, group=self.group)
        return x

    def _sum_in_rank_order(self, x: torch.Tensor) -> None:
        """``x`` replaced by the ranks' parts added in rank order (see the class docstring)."""
        parts = self.all_gather(x.reshape(1, -1))[:, 0]
        total = parts[0].float()  # a copy unless x is fp32: parts is this call's own buffer either way
        for part in parts[1:]:
            total.add_(part)
        x.copy_(total.view(x.shape))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x [R, C]``, stacked by rank: ``[size, R, C]`` (``x[None]`` with one rank)."""
        if self.size == 1:
            return x[None]
        import torch.distributed as dist

        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)


    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value``."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def make_collectives(size: int, *, kind: str, dtype: torch.dtype, device: torch.device,
                     invariant: bool = False) -> Collectives:
    """The default process group's :class:`Collectives` (every rank calls it, after joining the
    group): ``kind`` ``"symm_mem"`` sets up the one-shot all-reduce, a collective itself (not with
    ``invariant``, the batch-invariant sums, which do not use it)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    fast = SymmMemAllReduce(group, dtype=dtype, device=device) if kind == "symm_mem" and not invariant else None
    return Collectives(size, group, fast, device, invariant)


class SymmMemAllReduce:
    """A one-shot all-reduce through torch's symmetric memory for messages up to ``max_bytes``: the
    input is copied into this rank's symmetric buffer and one kernel reads every peer's buffer and
    sums (NVLink peer loads; no multicast). Other messages (larger, or another dtype) go to the
    process group's all-reduce. CUDA-graph capturable like the group's.

    ``one_shot``: the operation ``(buffer, "sum", group_name, out)``; tests pass a stand-in."""

    def __init__(self, group, *, dtype: torch.dtype, device: torch.device, max_bytes: int = SYMM_MEM_MAX_BYTES,
                 one_shot=None):
        if device.type != "cuda" and one_shot is None:
            raise ValueError(f"{ALLREDUCE_ENV}=symm_mem needs CUDA devices (symmetric memory), got {device}; "
                             "unset it to use the process group's all-reduce")
        self.group = group
        self.group_name = group.group_name
        numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        if one_shot is None:
            from torch.distributed import _symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(self.group_name)
            self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
            symm_mem.rendezvous(self.buffer, self.group_name)
            one_shot = torch.ops.symm_mem.one_shot_all_reduce_out
        else:
            self.buffer = torch.zeros(numel, dtype=dtype, device=device)
        self._one_shot = one_shot

    def __call__(self, x: torch.Tensor) -> None:
        n = x.numel()
        if n > self.buffer.numel() or x.dtype != self.buffer.dtype or not x.is_contiguous():
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
            return
        buf = self.buffer[:n]
        buf.copy_(x.view(-1))
        self._one_shot(buf, "sum", self.group_name, x.view(-1))

"""The layers every family is built from, and the causal LM around a family's decoder layer.

The forward takes the step's tokens packed into one row, ``input_ids [T]`` and ``positions [T]``,
whatever mix of prefill chunks and decode tokens they are, and an :class:`AttentionMetadata` that
says which sequence each token belongs to and where its keys and values live in the paged cache.
Every layer writes its new K/V into the cache (``write_kv_cache``) and then runs one paged
attention launch over all sequences (``flash_attn_varlen_func`` with ``block_table``), with its own
window, softcap and softmax scale.

Parameters carry Hugging Face names except two fused projections: ``qkv_proj`` (q, k, v stacked on
the output dim) and ``gate_up_proj`` (gate, up); :mod:`pagedflash.engine.weights` maps HF tensors
onto them. Norm weights hold the factor the norm multiplies by: Gemma's ``1 + w`` is stored as such
(``ModelConfig.norm_offset`` is added at load), so every norm runs the same kernels.

Tensor parallelism: built with a :class:`~pagedflash.engine.parallel.ShardSizes` of ``N > 1`` ranks,
the model holds this rank's shard (its heads, MLP rows and vocabulary rows) and joins the ranks with
:class:`~pagedflash.engine.parallel.Collectives`: one all-reduce after the embedding, after
``o_proj`` and after ``down_proj``, one of a scalar per row for each q/k norm over the whole
projection (OLMo 2), and a gather of the logits. With one rank (the default) no collective runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from pagedflash import flash_attn_varlen_func, write_kv_cache
from pagedflash.engine import layers
from pagedflash.engine.config import ModelConfig
from pagedflash.engine.parallel import Collectives, ShardSizes


@dataclass
class AttentionMetadata:
    """Per-step layout of the packed tokens; the same for every layer.

    ``B`` sequences, ``T`` tokens. Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
    and attends its first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` cached tokens (prefix plus the new
    ones, bottom-right causal), read through ``block_tables[b]``.
    """

    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token (-1: do not write)
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    cu_seqlens_k: torch.Tensor  # int32 [B + 1]
    max_seqlen_q: int  # host upper bounds
    max_seqlen_k: int
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    num_splits: int = 0  # 0: kernel chooses; fixed >= 1 for CUDA-graph capture


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``(norm(x + residual), x + residual)``; the sum is the residual stream going on."""
        return layers.rms_norm(x, self.weight, self.eps, residual)


def residual_branch(h: torch.Tensor, multiplier: float) -> torch.Tensor:
    """A residual branch's output ``h`` as added to the stream: times Granite's ``residual_multiplier``
    (in place; ``h`` as it is for 1)."""
    return h if multiplier == 1.0 else h.mul_(multiplier)


class ProjectionNorm(nn.Module):
    """RMSNorm over a whole projection (OLMo 2's q/k norm) whose ``dim`` columns may be split over
    the ranks: this rank holds ``weight [dim / N]`` and the mean square is summed over the ranks
    (a replicated KV head counted once per rank that holds it, and divided out likewise). In the
    batch-invariant mode a rank's sum of squares is a fixed tree of elementwise adds
    (:func:`_row_sum`): a library reduction lays a row's additions out by the number of rows."""

    def __init__(self, local_dim: int, eps: float, comm: Collectives):
        super().__init__()
        self.eps, self.comm = eps, comm
        self.weight = nn.Parameter(torch.ones(local_dim))
        self.batch_invariant = False  # CausalLM.make_batch_invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return layers.rms_norm(x.contiguous(), self.weight, self.eps)[0]
        xf = x.float()
        squares = xf.square()
        local = _row_sum(squares) if self.batch_invariant else squares.sum(-1, keepdim=True)
        square_sum = self.comm.all_reduce(local)
        mean = square_sum / (x.shape[-1] * self.comm.size)
        return (xf * torch.rsqrt(mean + self.eps)).to(x.dtype) * self.weight


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x [T, C]`` summed along each row ``[T, 1]`` by halving: the first half plus the second (an odd
    column carried), until one column is left. Elementwise adds only, so a row's bits never depend
    on ``T``."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        pairs = x[:, :half] + x[:, half : 2 * half]
        x = torch.cat([pairs, x[:, 2 * half :]], dim=-1) if x.shape[-1] % 2 else pairs
    return x


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[max_len, rotary_dim]`` in fp32 (rotate-half layout) of ``config``'s RoPE
    (``local``: the sliding layers'), computed on the CPU as transformers computes them
    (:func:`pagedflash.engine.weights.build_model` moves them to the device). ``rotary_dim``: the
    dims of each head rotated, the first ones (``config.rotary_dim``: the whole head, or Phi-3's
    partial rotary); the rest of a head is left alone."""

    def __init__(self, config: ModelConfig, max_len: int, local: bool = False):
        super().__init__()
        positions = torch.arange(max_len, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * config.inv_freq(local, max_len).cpu()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rotary_dim = emb.shape[1]
        factor = config.rope_attention_factor(local)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)


# Per-head q/k norms (qk_norm "head") inside the RoPE launch (pagedflash.ops.rope.rope_ with norm
# weights): one launch a layer where the unfused path takes five; off until a GPU has timed it.
# Its q/k differ from the unfused path's in the last bits (the normed heads are not rounded to the
# model's dtype before the rotation). Read at every forward (and at CUDA-graph capture).
FUSED_QK_NORM = os.environ.get("PAGEDFLASH_FUSED_QK_NORM", "0") == "1"


class Attention(nn.Module):
    """This rank's heads (all of them with one rank), with the layer's own window, softcap, softmax
    scale and RoPE (``local_rope``: the sliding layers' own tables) and, where the family has them,
    q/k norms before RoPE (``ModelConfig.qk_norm``; per head and whole heads rotated: inside the RoPE
    launch with :data:`FUSED_QK_NORM`) and a learned sink logit per head (``sinks``, fp32 whatever
    the model's dtype, as the kernels take it: GPT-OSS)."""

    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes, comm: Collectives):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
        self.softcap = config.attn_softcap
        sliding = config.is_sliding(layer)
        self.window = (config.sliding_window - 1, -1) if sliding else (-1, -1)
        self.local_rope = sliding and config.local_rope_theta is not None
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        elif config.qk_norm == "projection":
            self.q_norm = ProjectionNorm(self.q_size, config.rms_norm_eps, comm)
            self.k_norm = ProjectionNorm(self.kv_size, config.rms_norm_eps, comm)
        elif config.qk_norm:
            raise ValueError(f"qk_norm must be '', 'head' or 'projection', got {config.qk_norm!r}")
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32)) if config.attention_sinks else None
        self.kv_scales = (None, None)  # (k_scale, v_scale) of an fp8 cache: CausalLM.bind_kv_scales
        self.batch_invariant = False  # CausalLM.make_batch_invariant

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """q and k of ``qkv`` normed in place."""
        t, d = qkv.shape[0], self.head_dim
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        if self.qk_norm == "head":
            q.copy_(self.q_norm(q.reshape(-1, d))[0].view(t, -1))
            k.copy_(self.k_norm(k.reshape(-1, d))[0].view(t, -1))
        else:
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))

    def forward(self, qkv, positions, rope: RotaryEmbedding, meta: AttentionMetadata, kv_cache):
        """Attention of the projected ``qkv [T, (Hq + 2 Hkv) D]`` (the layer computes it with the norm
        fused in), through ``o_proj``: this rank's part of the output, which the layer sums over ranks."""
        t, d = qkv.shape[0], self.head_dim
        if self.qk_norm == "head" and FUSED_QK_NORM and rope.rotary_dim == d:
            layers.rope_(qkv, positions, rope.cos, rope.sin, self.num_heads + self.num_kv_heads, d,
                         q_norm_weight=self.q_norm.weight, k_norm_weight=self.k_norm.weight,
                         num_q_heads=self.num_heads, eps=self.q_norm.eps)
        else:
            if self.qk_norm:
                self._norm_qk(qkv)
            layers.rope_(qkv, positions, rope.cos, rope.sin, self.num_heads + self.num_kv_heads, d, rope.rotary_dim)
        q = qkv[:, : self.q_size].view(t, self.num_heads, d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, d)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, d)
        k_cache, v_cache = kv_cache
        k_scale, v_scale = self.kv_scales
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        o = flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=self.scale, causal=True, window_size=self.window, softcap=self.softcap,
            block_table=meta.block_tables, num_splits=meta.num_splits, sinks=self.sinks,
            k_descale=k_scale, v_descale=v_scale, batch_invariant=self.batch_invariant,
        )
        return layers.linear(o.reshape(t, self.q_size), self.o_proj)


class MLP(nn.Module):
    """This rank's rows of gate and up, the matching columns of down; SwiGLU or (Gemma) GeGLU."""

    def __init__(self, config: ModelConfig, shard: ShardSizes, intermediate_size: int | None = None):
        super().__init__()
        inter = shard.intermediate_size if intermediate_size is None else intermediate_size  # this rank's rows
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)
        self.act = "silu" if config.hidden_act == "silu" else "gelu_tanh"  # gelu_pytorch_tanh: Gemma's GeGLU

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``down_proj(act(gate) * up)`` of the projected ``gate_up [T, 2 I]``: this rank's part."""
        return layers.gated_linear(gate_up, self.down_proj, self.act)


class VocabEmbedding(nn.Module):
    """The token embedding ``weight [V, hidden]``, or with several ranks this rank's rows of it
    (``vocab_per_rank``, zero-padded): ids of other ranks' rows look up zeros and the all-reduce sums
    the ranks' lookups."""

    def __init__(self, config: ModelConfig, shard: ShardSizes, comm: Collectives):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, config.hidden_size))
        self.start, self.rows, self.comm = shard.vocab_start, shard.vocab_rows, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        return self.comm.all_reduce(x.masked_fill_(~inside[:, None], 0))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, shard: ShardSizes, comm: Collectives, layer_class):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config, shard, comm)
        self.layers = nn.ModuleList(layer_class(config, i, shard, comm) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], meta, kv_caches) -> hidden [T, hidden]``;
    :meth:`compute_logits` turns selected rows into fp32 logits ``[R, vocab]``. A family sets
    ``layer_class``: ``layer(x, residual, positions, rope, meta, kv_cache) -> (x, residual)``, the
    residual stream being ``x + residual`` (the next norm adds them).

    ``shard``/``comm``: this rank's part of a tensor-parallel model and its group (default: the
    whole model, one rank). ``kv_caches`` then hold this rank's KV heads (``shard.num_kv_heads``)."""

    layer_class: type[nn.Module]

    def __init__(self, config: ModelConfig, max_len: int, shard: ShardSizes | None = None,
                 comm: Collectives | None = None):
        super().__init__()
        self.config = config
        self.shard = shard or ShardSizes.of(config)
        self.comm = comm or Collectives()
        self.model = DecoderModel(config, self.shard, self.comm, self.layer_class)
        self.rotary_emb = RotaryEmbedding(config, max_len)
        self.rotary_emb_local = RotaryEmbedding(config, max_len, local=True) if config.local_rope_theta else None
        self.lm_head = nn.Linear(config.hidden_size, self.shard.vocab_per_rank, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def bind_kv_scales(self, kv_cache) -> None:
        """Use ``kv_cache``'s per-layer K/V scales (an fp8 cache's; None for others) in every layer's
        cache writes and attention. Device tensors, read at run time: CUDA graphs see later updates."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_scales = kv_cache.scales(i)

    def make_batch_invariant(self) -> None:
        """Every row's result the same bits whatever the other rows of a step: each layer's attention
        in the kernels' batch-invariant mode, every projection (LM head and MoE routers included)
        through the batch-invariant product (:func:`pagedflash.engine.layers.linear`), the experts
        of a MoE layer with one tile for every token count. Every module with a ``batch_invariant``
        attribute takes it. Norms, RoPE, activations and the sampler are row by row already."""
        for module in self.modules():
            if isinstance(module, nn.Linear) or hasattr(module, "batch_invariant"):
                module.batch_invariant = True

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        return self.model.norm(*self.forward_unnormed(input_ids, positions, meta, kv_caches))[0]

    def forward_unnormed(self, input_ids, positions, meta: AttentionMetadata, kv_caches):
        """The decoder stack without the final norm: ``(x, residual)``, normed by ``model.norm(x, residual)``."""
        x, residual = self.model.embed_tokens(input_ids), None
        if self.config.embedding_multiplier != 1.0:  # the factor rounded to the model's dtype, as transformers
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype).item()
        for layer, kv in zip(self.model.layers, kv_caches):
            rope = self.rotary_emb_local if layer.self_attn.local_rope else self.rotary_emb
            x, residual = layer(x, residual, positions, rope, meta, kv)
        return x, residual

    def logits_into(self, x, residual, out: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of ``forward_unnormed``'s output, written into ``out [T, vocab]``
        (the model's dtype; fused into one kernel on single rows; gathered over the ranks)."""
        local = out if self.comm.size == 1 else None
        if layers.single_row(x, self.lm_head) or layers.invariant(self.lm_head):
            local = layers.norm_linear(x, residual, self.model.norm, self.lm_head, out=local)[0]
        else:
            local = torch.mm(self.model.norm(x, residual)[0], self.lm_head.weight.t(), out=local)
        if self.comm.size > 1:
            out.copy_(self.gather_logits(local))
        return self.scale_logits_(out)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[R, vocab]`` of ``hidden [R, hidden]`` in the model's dtype (gathered over the ranks)."""
        return self.scale_logits_(self.gather_logits(layers.linear(hidden, self.lm_head)))

    def scale_logits_(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's last step on the LM logits, in place: divided by ``logits_scaling`` (Granite),
        then ``cap * tanh(logits / cap)`` (Gemma 2's final softcap)."""
        c = self.config
        if c.logits_scaling != 1.0:
            logits.div_(c.logits_scaling)
        if c.final_softcap:
            logits.div_(c.final_softcap).tanh_().mul_(c.final_softcap)
        return logits

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary shard of the logits ``local [R, vocab_per_rank]`` side by side,
        padding dropped: ``[R, vocab]`` (``local`` itself with one rank)."""
        if self.comm.size == 1:
            return local
        parts = self.comm.all_gather(local)  # [N, R, vocab_per_rank]
        return parts.permute(1, 0, 2).reshape(local.shape[0], -1)[:, : self.config.vocab_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(hidden).float()

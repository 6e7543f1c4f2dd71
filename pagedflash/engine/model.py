"""Llama-architecture decoder (Llama 2/3, Mistral, Qwen2) in plain PyTorch on pagedflash attention.

The forward takes the step's tokens packed into one row, ``input_ids [T]`` and ``positions [T]``,
whatever mix of prefill chunks and decode tokens they are, and an :class:`AttentionMetadata` that
says which sequence each token belongs to and where its keys and values live in the paged cache.
Every layer writes its new K/V into the cache (``write_kv_cache``) and then runs one paged
attention launch over all sequences (``flash_attn_varlen_func`` with ``block_table``).

Parameters carry Hugging Face names except two fused projections: ``qkv_proj`` (q, k, v stacked on
the output dim) and ``gate_up_proj`` (gate, up); :mod:`pagedflash.engine.weights` maps HF tensors
onto them.

Tensor parallelism: built with a :class:`~pagedflash.engine.parallel.ShardSizes` of ``N > 1`` ranks,
the model holds this rank's shard (its heads, MLP rows and vocabulary rows) and joins the ranks with
:class:`~pagedflash.engine.parallel.Collectives`: one all-reduce after the embedding, after
``o_proj`` and after ``down_proj``, and a gather of the logits (:mod:`pagedflash.engine.parallel`).
With one rank (the default) no collective runs.
"""

from __future__ import annotations

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


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[max_len, D]`` in fp32 (rotate-half layout), computed on the CPU as transformers
    computes its frequencies (:func:`pagedflash.engine.weights.build_model` moves them to the device)."""

    def __init__(self, config: ModelConfig, max_len: int):
        super().__init__()
        positions = torch.arange(max_len, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * config.inv_freq().cpu()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)


class Attention(nn.Module):
    """This rank's heads (all of them with one rank)."""

    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.window = (config.sliding_window - 1, -1) if config.is_sliding(layer) else (-1, -1)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.kv_scales = (None, None)  # (k_scale, v_scale) of an fp8 cache: CausalLM.bind_kv_scales

    def forward(self, qkv, positions, rope: RotaryEmbedding, meta: AttentionMetadata, kv_cache):
        """Attention of the projected ``qkv [T, (Hq + 2 Hkv) D]`` (the layer computes it with the norm
        fused in), through ``o_proj``: this rank's part of the output, which the layer sums over ranks."""
        t, d = qkv.shape[0], self.head_dim
        layers.rope_(qkv, positions, rope.cos, rope.sin, self.num_heads + self.num_kv_heads, d)
        q = qkv[:, : self.q_size].view(t, self.num_heads, d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, d)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, d)
        k_cache, v_cache = kv_cache
        k_scale, v_scale = self.kv_scales
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        o = flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=self.scale, causal=True, window_size=self.window, block_table=meta.block_tables,
            num_splits=meta.num_splits, k_descale=k_scale, v_descale=v_scale,
        )
        return layers.linear(o.reshape(t, self.q_size), self.o_proj)


class MLP(nn.Module):
    """This rank's rows of gate and up, the matching columns of down."""

    def __init__(self, config: ModelConfig, shard: ShardSizes):
        super().__init__()
        inter = shard.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)


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


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes, comm: Collectives):
        super().__init__()
        self.comm = comm
        self.self_attn = Attention(config, layer, shard)
        self.mlp = MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, rope, meta, kv_cache):
        """Pre-norm block; returns ``(mlp_out, residual)``. The residual add is fused into the next norm,
        and on single rows (batch-1 decode) each norm and the SiLU into the projection after them.
        With several ranks, the outputs of ``o_proj`` and ``down_proj`` are summed over them."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = layers.norm_linear(x, residual, self.input_layernorm, attn.qkv_proj)
        h = self.comm.all_reduce(attn(qkv, positions, rope, meta, kv_cache))
        gate_up, residual = layers.norm_linear(h, residual, self.post_attention_layernorm, mlp.gate_up_proj)
        return self.comm.all_reduce(layers.silu_mul_linear(gate_up, mlp.down_proj)), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, shard: ShardSizes, comm: Collectives):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config, shard, comm)
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard, comm) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], meta, kv_caches) -> hidden [T, hidden]``;
    :meth:`compute_logits` turns selected rows into fp32 logits ``[R, vocab]``.

    ``shard``/``comm``: this rank's part of a tensor-parallel model and its group (default: the
    whole model, one rank). ``kv_caches`` then hold this rank's KV heads (``shard.num_kv_heads``)."""

    def __init__(self, config: ModelConfig, max_len: int, shard: ShardSizes | None = None,
                 comm: Collectives | None = None):
        super().__init__()
        self.config = config
        self.shard = shard or ShardSizes.of(config)
        self.comm = comm or Collectives()
        self.model = DecoderModel(config, self.shard, self.comm)
        self.rotary_emb = RotaryEmbedding(config, max_len)
        self.lm_head = nn.Linear(config.hidden_size, self.shard.vocab_per_rank, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def bind_kv_scales(self, kv_cache) -> None:
        """Use ``kv_cache``'s per-layer K/V scales (an fp8 cache's; None for others) in every layer's
        cache writes and attention. Device tensors, read at run time: CUDA graphs see later updates."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_scales = kv_cache.scales(i)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        return self.model.norm(*self.forward_unnormed(input_ids, positions, meta, kv_caches))[0]

    def forward_unnormed(self, input_ids, positions, meta: AttentionMetadata, kv_caches):
        """The decoder stack without the final norm: ``(x, residual)``, normed by ``model.norm(x, residual)``."""
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, positions, self.rotary_emb, meta, kv)
        return x, residual

    def logits_into(self, x, residual, out: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head of ``forward_unnormed``'s output, written into ``out [T, vocab]``
        (the model's dtype; fused into one kernel on single rows; gathered over the ranks)."""
        local = out if self.comm.size == 1 else None
        if layers.single_row(x):
            local = layers.norm_linear(x, residual, self.model.norm, self.lm_head, out=local)[0]
        else:
            local = torch.mm(self.model.norm(x, residual)[0], self.lm_head.weight.t(), out=local)
        return out if self.comm.size == 1 else out.copy_(self.gather_logits(local))

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[R, vocab]`` of ``hidden [R, hidden]`` in the model's dtype (gathered over the ranks)."""
        return self.gather_logits(self.lm_head(hidden))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary shard of the logits ``local [R, vocab_per_rank]`` side by side,
        padding dropped: ``[R, vocab]`` (``local`` itself with one rank)."""
        if self.comm.size == 1:
            return local
        parts = self.comm.all_gather(local)  # [N, R, vocab_per_rank]
        return parts.permute(1, 0, 2).reshape(local.shape[0], -1)[:, : self.config.vocab_size]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_logits(hidden).float()

"""Llama-architecture decoder (Llama 2/3, Mistral, Qwen2) in plain PyTorch on pagedflash attention.

The forward takes the step's tokens packed into one row, ``input_ids [T]`` and ``positions [T]``,
whatever mix of prefill chunks and decode tokens they are, and an :class:`AttentionMetadata` that
says which sequence each token belongs to and where its keys and values live in the paged cache.
Every layer writes its new K/V into the cache (``write_kv_cache``) and then runs one paged
attention launch over all sequences (``flash_attn_varlen_func`` with ``block_table``).

Parameters carry Hugging Face names except two fused projections: ``qkv_proj`` (q, k, v stacked on
the output dim) and ``gate_up_proj`` (gate, up); :mod:`pagedflash.engine.weights` maps HF tensors
onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedflash import flash_attn_varlen_func, write_kv_cache
from pagedflash.engine import layers
from pagedflash.engine.config import ModelConfig


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
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.window = (config.sliding_window - 1, -1) if config.is_sliding(layer) else (-1, -1)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(self, qkv, positions, rope: RotaryEmbedding, meta: AttentionMetadata, kv_cache):
        """Attention of the projected ``qkv [T, (Hq + 2 Hkv) D]`` (the layer computes it with the norm
        fused in), through ``o_proj``."""
        t, d = qkv.shape[0], self.head_dim
        layers.rope_(qkv, positions, rope.cos, rope.sin, self.num_heads + self.num_kv_heads, d)
        q = qkv[:, : self.q_size].view(t, self.num_heads, d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, d)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, d)
        k_cache, v_cache = kv_cache
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        o = flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=self.scale, causal=True, window_size=self.window, block_table=meta.block_tables,
            num_splits=meta.num_splits,
        )
        return layers.linear(o.reshape(t, self.q_size), self.o_proj)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, rope, meta, kv_cache):
        """Pre-norm block; returns ``(mlp_out, residual)``. The residual add is fused into the next norm,
        and on single rows (batch-1 decode) each norm and the SiLU into the projection after them."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = layers.norm_linear(x, residual, self.input_layernorm, attn.qkv_proj)
        h = attn(qkv, positions, rope, meta, kv_cache)
        gate_up, residual = layers.norm_linear(h, residual, self.post_attention_layernorm, mlp.gate_up_proj)
        return layers.silu_mul_linear(gate_up, mlp.down_proj), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], meta, kv_caches) -> hidden [T, hidden]``;
    :meth:`compute_logits` turns selected rows into fp32 logits ``[R, vocab]``."""

    def __init__(self, config: ModelConfig, max_len: int):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.rotary_emb = RotaryEmbedding(config, max_len)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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
        (the model's dtype; fused into one kernel on single rows)."""
        if layers.single_row(x):
            return layers.norm_linear(x, residual, self.model.norm, self.lm_head, out=out)[0]
        return torch.mm(self.model.norm(x, residual)[0], self.lm_head.weight.t(), out=out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

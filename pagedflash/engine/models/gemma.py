"""Gemma 2 and Gemma 3 (text): norms before and after each branch, ``x + norm(attn(norm(x)))`` then
``x + norm(mlp(norm(x)))``, every norm scaling by ``1 + w`` (stored so, :mod:`.common`), GeGLU with
tanh GELU, the embedding times ``sqrt(hidden)``, softmax scale ``query_pre_attn_scalar ** -0.5``.

Gemma 2: sliding window on alternate layers, attention logits and LM logits softcapped.
Gemma 3: five sliding layers to one global, each kind with its own RoPE theta (and the global
layers' scaling), RMSNorm over each q and k head before RoPE; no softcaps.
"""

from __future__ import annotations

from torch import nn

from pagedflash.engine import layers
from pagedflash.engine.config import ModelConfig
from pagedflash.engine.models.common import MLP, Attention, CausalLM, RMSNorm
from pagedflash.engine.parallel import Collectives, ShardSizes


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes, comm: Collectives):
        super().__init__()
        self.comm = comm
        self.self_attn = Attention(config, layer, shard, comm)
        self.mlp = MLP(config, shard)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(self, x, residual, positions, rope, meta, kv_cache):
        """Sandwich-norm block; returns ``(normed mlp_out, residual)`` (the next norm adds them)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = layers.norm_linear(x, residual, self.input_layernorm, attn.qkv_proj)
        h = self.comm.all_reduce(attn(qkv, positions, rope, meta, kv_cache))
        h = self.post_attention_layernorm(h)[0]
        out, residual = layers.norm_mlp(h, residual, self.pre_feedforward_layernorm, mlp)
        return self.post_feedforward_layernorm(self.comm.all_reduce(out))[0], residual


class GemmaForCausalLM(CausalLM):
    layer_class = GemmaDecoderLayer

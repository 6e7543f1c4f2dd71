"""OLMo 2: norms after each branch instead of before it, ``x + norm(attn(x))`` then
``x + norm(mlp(x))``, and RMSNorm over the whole q and k projections (all heads together) before
RoPE (:class:`~pagedflash.engine.models.common.ProjectionNorm`, which sums over tensor-parallel ranks)."""

from __future__ import annotations

from torch import nn

from pagedflash.engine import layers
from pagedflash.engine.config import ModelConfig
from pagedflash.engine.models.common import MLP, Attention, CausalLM, RMSNorm
from pagedflash.engine.parallel import Collectives, ShardSizes


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes, comm: Collectives):
        super().__init__()
        self.comm = comm
        self.self_attn = Attention(config, layer, shard, comm)
        self.mlp = MLP(config, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, rope, meta, kv_cache):
        """Post-norm block; returns ``(normed mlp_out, residual)`` (the next layer adds them)."""
        attn, mlp = self.self_attn, self.mlp
        stream = x if residual is None else x + residual
        h = self.comm.all_reduce(attn(layers.linear(stream, attn.qkv_proj), positions, rope, meta, kv_cache))
        stream = stream + self.post_attention_layernorm(h)[0]
        m = self.comm.all_reduce(layers.mlp(stream, mlp))
        return self.post_feedforward_layernorm(m)[0], stream


class Olmo2ForCausalLM(CausalLM):
    layer_class = Olmo2DecoderLayer

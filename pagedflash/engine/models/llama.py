"""The pre-norm decoder of Llama 2/3, Mistral, Qwen2, Qwen3, Granite and Phi-3: ``x + attn(norm(x))``,
then ``x + mlp(norm(x))``.

The families differ only in what the shared layers of :mod:`.common` read from the config: Mistral
and Qwen2 a sliding window (Qwen2 in some layers), Qwen2 the q/k/v biases, Qwen3 an RMSNorm over
each q and k head before RoPE, Granite its multipliers (embedding, softmax scale, the residual
branches here, the logits), Phi-3 its fused checkpoint tensors (:mod:`pagedflash.engine.weights`).
"""

from __future__ import annotations

from torch import nn

from pagedflash.engine import layers
from pagedflash.engine.config import ModelConfig
from pagedflash.engine.models.common import MLP, Attention, CausalLM, RMSNorm, residual_branch
from pagedflash.engine.parallel import Collectives, ShardSizes


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes, comm: Collectives):
        super().__init__()
        self.comm = comm
        self.self_attn = Attention(config, layer, shard, comm)
        self.mlp = MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x, residual, positions, rope, meta, kv_cache):
        """Pre-norm block; returns ``(mlp_out, residual)``. The residual add is fused into the next norm,
        and on single rows (batch-1 decode) each norm and the SiLU into the projection after them.
        With several ranks, the outputs of ``o_proj`` and ``down_proj`` are summed over them."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = layers.norm_linear(x, residual, self.input_layernorm, attn.qkv_proj)
        h = residual_branch(self.comm.all_reduce(attn(qkv, positions, rope, meta, kv_cache)), self.residual_multiplier)
        out, residual = layers.norm_mlp(h, residual, self.post_attention_layernorm, mlp)
        return residual_branch(self.comm.all_reduce(out), self.residual_multiplier), residual


class LlamaForCausalLM(CausalLM):
    layer_class = LlamaDecoderLayer

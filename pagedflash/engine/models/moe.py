"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE and GPT-OSS. The
pre-norm block of Llama, ``x + attn(norm(x))`` then ``x + moe(norm(x))``, whose MLP is a router and
``E`` expert MLPs of which each token runs ``top_k`` (:mod:`pagedflash.ops.moe`: ``route`` then
``fused_moe``).

- Mixtral: Mistral's attention (a sliding window when configured); softmax over the experts, top-k,
  renormalized; SiLU-gated experts without biases.
- Qwen2-MoE: Qwen2's attention (q/k/v biases by ``qkv_bias``; a window on every other layer below
  ``max_window_layers`` with ``use_sliding_window``); the router as Qwen3-MoE's; beside the routed
  experts a shared expert every token runs, a SiLU-gated MLP of ``shared_expert_intermediate_size``
  scaled by ``sigmoid(shared_expert_gate(x))`` (the gate a last row of the router's weight).
- Qwen3-MoE: Qwen3's attention (RMSNorm over each q and k head); top-k renormalized only with
  ``norm_topk_prob``; dense MLP layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say.
- OLMoE: Llama's attention with OLMo 2's RMSNorm over the whole q and k projections (summed over
  tensor-parallel ranks); Mixtral's router with ``norm_topk_prob``; SiLU-gated experts of
  ``intermediate_size``.
- Granite-MoE: Granite's multipliers (embedding, softmax scale, residual branches, logits) over
  Mixtral's layout; a router taking the top-k logits, then a softmax over them (GPT-OSS's rule, no
  bias); SiLU-gated experts of ``intermediate_size``, stored fused in the checkpoint.
- GPT-OSS: q/k/v/o biases, a learned sink logit per head, a 128-token window on alternate layers,
  YaRN RoPE; a router with a bias, top-k of its logits then softmax over those k; experts with biases
  and the clamped SwiGLU (``(up + 1) * g * sigmoid(alpha g)``, ``g = min(gate, limit)``,
  ``up = clamp(up, -limit, limit)``).

Expert weights are held as ``w13 [E, 2 I, H]`` (each expert's gate rows, then its up rows) and
``w2 [E, H, I]``, GPT-OSS's biases as ``w13_bias [E, 2 I]`` and ``w2_bias [E, H]``;
:mod:`pagedflash.engine.weights` reads them from each family's checkpoint layout. Tensor parallelism: each
rank holds rows ``[r I/N, (r+1) I/N)`` of every expert's gate and up and those columns of its down,
the router whole, ``w2_bias`` on rank 0; the layer's output is summed by one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedflash.engine import layers
from pagedflash.engine.config import ModelConfig
from pagedflash.engine.models.common import MLP, Attention, CausalLM, RMSNorm, residual_branch
from pagedflash.engine.parallel import Collectives, ShardSizes


class Experts(nn.Module):
    """This rank's part of the ``E`` expert MLPs (see the module docstring)."""

    def __init__(self, config: ModelConfig, shard: ShardSizes):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, shard.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i)) if config.moe_bias else None
        self.w2_bias = nn.Parameter(torch.empty(e, h)) if config.moe_bias else None
        self.activation = config.moe_activation
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.batch_invariant = False  # CausalLM.make_batch_invariant

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return layers.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, activation="silu",
                                    invariant=self.batch_invariant)
        return layers.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, activation=self.activation,
                                w13_bias=self.w13_bias, w2_bias=self.w2_bias, alpha=self.alpha, limit=self.limit,
                                invariant=self.batch_invariant)


class SparseMoE(nn.Module):
    """Router and experts, and Qwen2-MoE's shared expert; ``forward(x [T, H]) -> [T, H]``, this rank's
    part of the sum. The router carries its checkpoint's name (``gate``; GPT-OSS: ``router``); with a
    shared expert its weight holds the expert's one-column gate (``shared_expert_gate``) as a last
    row, so one product gives the ``E`` router logits and the gate's."""

    def __init__(self, config: ModelConfig, shard: ShardSizes, router_name: str = "gate"):
        super().__init__()
        self.router_name = router_name
        self.num_experts = config.num_experts
        shared = config.shared_expert_intermediate_size > 0
        setattr(self, router_name, nn.Linear(config.hidden_size, config.num_experts + shared, bias=config.moe_bias))
        self.experts = Experts(config, shard)
        self.top_k, self.scoring, self.renormalize = config.num_experts_per_tok, config.moe_scoring, config.moe_renormalize
        # every token's: x + sigmoid(x . g) * mlp(x), the MLP split over the ranks as a dense one, its
        # gate g whole on every rank (the all-reduce then sums the gate times the ranks' parts)
        self.shared_expert = MLP(config, shard, shard.shared_expert_intermediate_size) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = layers.linear(x, getattr(self, self.router_name))
        e = self.num_experts
        weights, ids = layers.moe_route(logits[:, :e], self.top_k, scoring=self.scoring, renormalize=self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is None:
            return out
        shared = layers.mlp(x, self.shared_expert)
        return out.addcmul_(torch.sigmoid(logits[:, e:]), shared)


class MoeDecoderLayer(nn.Module):
    """Pre-norm block with a mixture of experts (or, in a Qwen2/3-MoE dense layer, a dense MLP) under
    the checkpoint's name for it (``moe_name``)."""

    moe_name = "mlp"
    router_name = "gate"

    def __init__(self, config: ModelConfig, layer: int, shard: ShardSizes, comm: Collectives):
        super().__init__()
        self.comm = comm
        self.self_attn = Attention(config, layer, shard, comm)
        self.sparse = config.is_moe(layer)
        mlp = SparseMoE(config, shard, self.router_name) if self.sparse else MLP(config, shard)
        setattr(self, self.moe_name, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x, residual, positions, rope, meta, kv_cache):
        """As :class:`~pagedflash.engine.models.llama.LlamaDecoderLayer`: ``(mlp_out, residual)``, the
        outputs of ``o_proj`` and of the MLP summed over the ranks (times Granite's ``residual_multiplier``)."""
        attn, mlp = self.self_attn, getattr(self, self.moe_name)
        qkv, residual = layers.norm_linear(x, residual, self.input_layernorm, attn.qkv_proj)
        h = residual_branch(self.comm.all_reduce(attn(qkv, positions, rope, meta, kv_cache)), self.residual_multiplier)
        if self.sparse:
            h, residual = self.post_attention_layernorm(h, residual)
            out = mlp(h)
        else:
            out, residual = layers.norm_mlp(h, residual, self.post_attention_layernorm, mlp)
        return residual_branch(self.comm.all_reduce(out), self.residual_multiplier), residual


class MixtralDecoderLayer(MoeDecoderLayer):
    moe_name = "block_sparse_moe"


class GraniteMoeDecoderLayer(MoeDecoderLayer):
    moe_name = "block_sparse_moe"
    router_name = "router"


class GptOssDecoderLayer(MoeDecoderLayer):
    router_name = "router"


class MixtralForCausalLM(CausalLM):
    layer_class = MixtralDecoderLayer


class Qwen2MoeForCausalLM(CausalLM):
    layer_class = MoeDecoderLayer


class Qwen3MoeForCausalLM(CausalLM):
    layer_class = MoeDecoderLayer


class OlmoeForCausalLM(CausalLM):
    layer_class = MoeDecoderLayer


class GraniteMoeForCausalLM(CausalLM):
    layer_class = GraniteMoeDecoderLayer


class GptOssForCausalLM(CausalLM):
    layer_class = GptOssDecoderLayer

"""A config that leaves keys out means to the engine what it means to transformers: for every family
(and a few spellings of RoPE and windows), :class:`ModelConfig` from a config holding only the keys
the engine requires equals what the family's transformers config class makes of the same dict
(``AutoConfig.for_model``): head_dim, KV heads, eps, tied head, window per layer, softcaps, softmax
scale, multipliers, experts, and the RoPE inverse frequencies and attention factor of transformers'
own rotary module. The models' tokens with such configs: ``test_model_families.py``."""

import importlib

import pytest
import torch

from pagedflash.engine import ModelConfig
from pagedflash.engine.config import FAMILIES

transformers = pytest.importorskip("transformers")

# the keys the engine requires; 32 heads: a multiple of every family's default num_key_value_heads
REQUIRED = dict(vocab_size=128, hidden_size=512, intermediate_size=64, num_hidden_layers=8, num_attention_heads=32)
_HALF = 8  # head_dim / 2 of REQUIRED where no family default sets head_dim

# case -> (architecture, keys beyond REQUIRED)
CASES = {fam.name: (arch, {}) for arch, fam in FAMILIES.items()}
CASES.update({
    # Phi-3: the config's own original_max_position_embeddings (default 4096) wins over the scaling's
    "phi3-longrope": ("Phi3ForCausalLM", dict(max_position_embeddings=131072, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(_HALF)],
        "long_factor": [2.0 + i for i in range(_HALF)], "original_max_position_embeddings": 64})),
    "phi3-yarn": ("Phi3ForCausalLM", dict(max_position_embeddings=131072, rope_scaling={  # Phi-3: longrope's early name
        "type": "yarn", "short_factor": [1.0] * _HALF, "long_factor": [4.0] * _HALF})),
    # partial rotary: frequencies over int(head_dim * factor) dims (16 * 0.75 = 12), the factor at the
    # top level or in the RoPE dict; longrope's lists one number per rotated pair
    "phi3-partial": ("Phi3ForCausalLM", dict(partial_rotary_factor=0.75)),
    "phi3-partial-longrope": ("Phi3ForCausalLM", dict(max_position_embeddings=131072, rope_scaling={
        "rope_type": "longrope", "partial_rotary_factor": 0.5, "short_factor": [1.0 + i / 8 for i in range(_HALF // 2)],
        "long_factor": [2.0 + i for i in range(_HALF // 2)], "original_max_position_embeddings": 64})),
    # Gemma 3: the older spelling's scaling on the global layers, each theta its default
    "gemma3-rope-scaling": ("Gemma3ForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "gemma3-local-base-freq": ("Gemma3ForCausalLM", dict(rope_theta=500000.0, rope_local_base_freq=777.0)),
    # rope_parameters keyed by type without the sliding layers': the default RoPE there, theta 1e4
    "gemma3-full-only": ("Gemma3ForCausalLM", dict(rope_parameters={"full_attention": {"rope_type": "linear",
                                                                                      "factor": 8.0}})),
    "gemma3-pattern": ("Gemma3ForCausalLM", dict(sliding_window_pattern=3)),
    "qwen3-window": ("Qwen3ForCausalLM", dict(use_sliding_window=True, max_window_layers=3)),
    "qwen3_moe-window": ("Qwen3MoeForCausalLM", dict(use_sliding_window=True)),
    # Qwen2-MoE: every other layer below max_window_layers slides
    "qwen2_moe-window": ("Qwen2MoeForCausalLM", dict(use_sliding_window=True, max_window_layers=3)),
    "qwen2_moe-no-qkv-bias": ("Qwen2MoeForCausalLM", dict(qkv_bias=False)),
    "mixtral-num-experts": ("MixtralForCausalLM", dict(num_experts=4)),  # num_local_experts' other name
})


def hf_config(arch, extra):
    model_type = FAMILIES[arch].model_types[0]
    return transformers.AutoConfig.for_model(model_type, **REQUIRED, **extra)


def hf_rope(c, model_type):
    """``{layer kind: (inv_freq, attention factor)}`` of transformers' rotary module for config ``c``."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = next(v for k, v in vars(module).items() if k.endswith("RotaryEmbedding") and isinstance(v, type))(c)
    buffers = dict(rotary.named_buffers())
    if "inv_freq" in buffers:
        return {"": (buffers["inv_freq"], float(rotary.attention_scaling))}
    return {t: (buffers[f"{t}_inv_freq"], float(getattr(rotary, f"{t}_attention_scaling")))
            for t in ("full_attention", "sliding_attention")}


def expected(c, family):
    """What transformers' models compute from config ``c`` (read from its public attributes)."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0)  # Granite-MoE: no alias
    gemma = family in ("gemma2", "gemma3")
    scalar = getattr(c, "query_pre_attn_scalar", None) or head_dim
    return dict(
        num_kv_heads=c.num_key_value_heads, head_dim=head_dim, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
        # a window on the layers layer_types says (every layer where the class has no layer_types)
        sliding=[window if window and (types is None or types[i] == "sliding_attention") else None
                 for i in range(c.num_hidden_layers)],
        attention_scale=c.attention_multiplier if family in ("granite", "granitemoe") and c.attention_multiplier is not None
        else scalar ** -0.5,
        attn_softcap=(c.attn_logit_softcapping or 0.0) if family == "gemma2" else 0.0,  # Gemma 3 ignores it
        final_softcap=getattr(c, "final_logit_softcapping", None) or 0.0,
        embedding_multiplier=c.hidden_size ** 0.5 if gemma else getattr(c, "embedding_multiplier", 1.0),
        residual_multiplier=getattr(c, "residual_multiplier", 1.0), logits_scaling=getattr(c, "logits_scaling", 1.0),
        qkv_bias=family == "qwen2" or getattr(c, "qkv_bias", False) or getattr(c, "attention_bias", False),
        mlp_bias=getattr(c, "mlp_bias", False),
        num_experts=experts, num_experts_per_tok=getattr(c, "num_experts_per_tok", 0) if experts else 0,
        moe_intermediate_size=getattr(c, "moe_intermediate_size", c.intermediate_size) if experts else 0,
        moe_renormalize=getattr(c, "norm_topk_prob", family == "mixtral") if experts else None,
        dense_layers=[i for i in range(c.num_hidden_layers) if i in (getattr(c, "mlp_only_layers", None) or [])
                      or (i + 1) % getattr(c, "decoder_sparse_step", 1)],
        # older transformers (5.17) has no such keys: its GPT-OSS experts hard-code 1.702 and 7.0
        swiglu=(getattr(c, "swiglu_alpha", 1.702), getattr(c, "swiglu_limit", 7.0)) if family == "gpt_oss" else None,
        shared_expert=getattr(c, "shared_expert_intermediate_size", 0) if experts else 0,
    )


def engine(config):
    """The same quantities from the engine's :class:`ModelConfig`."""
    moe = config.num_experts > 0
    return dict(
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings,
        sliding=[config.sliding_window if config.is_sliding(i) else None for i in range(config.num_layers)],
        attention_scale=config.attention_scale or config.head_dim ** -0.5,
        attn_softcap=config.attn_softcap, final_softcap=config.final_softcap,
        embedding_multiplier=config.embedding_multiplier, residual_multiplier=config.residual_multiplier,
        logits_scaling=config.logits_scaling, qkv_bias=config.qkv_bias, mlp_bias=config.mlp_bias,
        num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size if moe else 0,
        moe_renormalize=config.moe_renormalize if moe else None, dense_layers=list(config.dense_layers),
        swiglu=(config.swiglu_alpha, config.swiglu_limit) if config.moe_activation == "swigluoai" else None,
        shared_expert=config.shared_expert_intermediate_size,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_left_out_keys_mean_what_they_mean_to_transformers(case):
    arch, extra = CASES[case]
    config = ModelConfig.from_dict({"architectures": [arch], **REQUIRED, **extra})
    c = hf_config(arch, extra)
    assert engine(config) == expected(c, config.family)
    rope = hf_rope(c, FAMILIES[arch].model_types[0].removesuffix("_text"))
    for kind, (inv_freq, factor) in rope.items():
        local = kind == "sliding_attention" and config.local_rope_theta is not None
        torch.testing.assert_close(config.inv_freq(local=local), inv_freq.float(), rtol=1e-6, atol=0)
        assert config.rope_attention_factor(local=local) == pytest.approx(factor, rel=1e-6), kind


@pytest.mark.parametrize("case", [c for c in CASES if "-" not in c])
def test_left_out_keys_read_as_the_written_defaults(case):
    """The same family from transformers' own config object (every key written out by ``to_dict``)
    gives the same ModelConfig, field for field (but the EOS ids: transformers' class defaults)."""
    arch, extra = CASES[case]
    config = ModelConfig.from_dict({"architectures": [arch], **REQUIRED, **extra})
    full = ModelConfig.from_hf_config(hf_config(arch, extra))
    full.eos_token_ids, full.torch_dtype = config.eos_token_ids, config.torch_dtype
    assert full == config


def test_gemma3_single_rope_parameters_refused():
    """An unkeyed rope_parameters under Gemma 3 is refused (transformers 5 ignores its values)."""
    with pytest.raises(ValueError, match="Gemma3ForCausalLM's rope_parameters must be keyed by layer type"):
        ModelConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], **REQUIRED,
                               "rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})


def test_ignored_bias_keys_stay_ignored():
    """Where transformers' model has no such switch (Mistral's attention, Qwen3's MLP) the key is
    ignored: the bias tensors of such a checkpoint are left over and fail strict loading by name."""
    config = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], **REQUIRED, "attention_bias": True})
    assert not config.qkv_bias and not config.o_bias
    assert not ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], **REQUIRED, "mlp_bias": True}).mlp_bias

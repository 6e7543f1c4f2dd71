"""Strict loading: a checkpoint whose math the engine would get wrong is refused, naming why.

Every checkpoint tensor is used or the load fails naming the leftovers; a config key that changes
the math and is not implemented for the architecture fails naming the key; unsupported RoPE
scalings fail by name; Qwen3, Granite, Gemma 2 and Gemma 3 checkpoints relabelled as
``LlamaForCausalLM`` (with or without their ``model_type``) are refused."""

import json

import pytest
import torch
from test_model_families import TINY, save_family

from pagedflash.engine import LLM, ModelConfig

transformers = pytest.importorskip("transformers")

LLAMA = {**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def relabel(path, **changes):
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(changes)
    cfg_file.write_text(json.dumps(cfg))


def load(path):
    return LLM(path, dtype=torch.float32, num_blocks=8)


@pytest.mark.parametrize("family, reason", [
    ("qwen3", r"LlamaForCausalLM does not use: 'model\.layers\.0\.self_attn\.k_norm\.weight', 'model\.layers\.0\.self_attn\.q_norm\.weight'"),
    ("granite", "embedding_multiplier=3.0"),
    ("gemma2", "query_pre_attn_scalar=24"),
    ("gemma3", "query_pre_attn_scalar=24"),
])
def test_relabelled_checkpoints_are_refused(tmp_path, family, reason):
    save_family(tmp_path, family)
    relabel(tmp_path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="model_type='.*' does not belong to architecture LlamaForCausalLM"):
        load(tmp_path)
    relabel(tmp_path, model_type="llama")  # relabelled through and through: the keys and tensors say it
    with pytest.raises(ValueError, match=reason):
        load(tmp_path)


def test_unused_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=True))
    hf.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    # what carries nothing the model lacks is allowed: RoPE's inverse frequencies, a tied head's copy
    allowed = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
               "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}
    save_file({**tensors, **allowed}, file, metadata={"format": "pt"})
    load(tmp_path)
    extra = {f"model.layers.{i}.mlp.extra_norm.weight": torch.ones(64) for i in range(5)}
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not use: 'model\.layers\.0\.mlp\.extra_norm\.weight'.* and 2 more"):
        load(tmp_path)


@pytest.mark.parametrize("key, value", [
    ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("query_pre_attn_scalar", 256),
    ("hidden_activation", "gelu_pytorch_tanh"), ("residual_multiplier", 0.22), ("attention_multiplier", 1.0),
    ("logits_scaling", 8.0), ("embedding_multiplier", 12.0), ("partial_rotary_factor", 0.5),
    ("num_local_experts", 8), ("use_qk_norm", True),
])
def test_math_keys_a_family_does_not_implement_are_refused(key, value):
    with pytest.raises(ValueError, match=f"{key}={value!r} changes the model's math and is not implemented "
                                         "for LlamaForCausalLM"):
        ModelConfig.from_dict({**LLAMA, key: value})
    ModelConfig.from_dict({**LLAMA, key: None})  # the neutral value is no change


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM"])
@pytest.mark.parametrize("where", ["rope_parameters", "rope_scaling"])
def test_partial_rotary_outside_phi3_is_refused_in_any_spelling(arch, where):
    """Only Phi-3's transformers model rotates part of a head; the others rotate whole heads with the
    default RoPE (the key ignored) and fail with a scaled one, so the key is refused wherever it sits."""
    rope = {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match=f"partial_rotary_factor=0.5 changes the model's math and is not "
                                         f"implemented for {arch}"):
        ModelConfig.from_dict({**TINY, "architectures": [arch], where: rope})


def test_phi3_partial_rotary_is_read_and_checked():
    phi3 = {**TINY, "architectures": ["Phi3ForCausalLM"]}
    assert ModelConfig.from_dict({**phi3, "partial_rotary_factor": 0.75}).rotary_dim == 12
    config = ModelConfig.from_dict({**phi3, "partial_rotary_factor": 1.0,  # the RoPE dict's wins, as transformers
                                    "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})
    assert (config.rotary_dim, config.inv_freq().shape) == (8, (4,))
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.3125 rotates int\(head_dim 16 \* 0.3125\) = 5 dims"):
        ModelConfig.from_dict({**phi3, "partial_rotary_factor": 0.3125})
    for bad in (0, 1.5, "0.5", True):
        with pytest.raises(ValueError, match=r"partial_rotary_factor must be a number in \(0, 1\]"):
            ModelConfig.from_dict({**phi3, "partial_rotary_factor": bad})
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                "original_max_position_embeddings": 64}
    ModelConfig.from_dict({**phi3, "rope_scaling": longrope})
    with pytest.raises(ValueError, match=r"longrope RoPE scaling needs 'short_factor': 4 numbers"):
        ModelConfig.from_dict({**phi3, "partial_rotary_factor": 0.5, "rope_scaling": longrope})


def test_neutral_values_and_implemented_keys_load():
    ModelConfig.from_dict({**LLAMA, "residual_multiplier": 1.0, "partial_rotary_factor": 1.0,
                           "attn_logit_softcapping": None})
    granite = ModelConfig.from_dict({**TINY, "architectures": ["GraniteForCausalLM"], "residual_multiplier": 0.22,
                                     "attention_multiplier": 0.0078125, "logits_scaling": 8.0})
    assert (granite.residual_multiplier, granite.attention_scale, granite.logits_scaling) == (0.22, 0.0078125, 8.0)
    with pytest.raises(ValueError, match="query_pre_attn_scalar=256.*GraniteForCausalLM"):
        ModelConfig.from_dict({**TINY, "architectures": ["GraniteForCausalLM"], "query_pre_attn_scalar": 256})


@pytest.mark.parametrize("scaling", ["dynamic", "mrope"])  # yarn is supported (GPT-OSS)
def test_unsupported_rope_scalings_fail_by_name(scaling):
    params = {"rope_type": scaling, "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=f"unsupported RoPE scaling '{scaling}'"):
        ModelConfig.from_dict({**LLAMA, "rope_parameters": params})
    with pytest.raises(ValueError, match=f"unsupported RoPE scaling '{scaling}'"):
        ModelConfig.from_dict({**LLAMA, "rope_scaling": {"type": scaling, "factor": 4.0}})


def test_su_is_longrope():
    """``su``, longrope's first name (Phi-3-128k's configs), loads as longrope (transformers does)."""
    half = ModelConfig.from_dict(LLAMA).head_dim // 2
    scaling = {"type": "su", "short_factor": [1.0] * half, "long_factor": [2.0] * half,
               "original_max_position_embeddings": 16}
    config = ModelConfig.from_dict({**LLAMA, "rope_scaling": scaling})
    assert config.rope_scaling["rope_type"] == "longrope"


def test_per_layer_rope_only_where_the_family_has_it():
    by_type = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    with pytest.raises(ValueError, match="rope_parameters per layer type .* not implemented for LlamaForCausalLM"):
        ModelConfig.from_dict({**LLAMA, "rope_parameters": by_type})
    gemma3 = ModelConfig.from_dict({**TINY, "architectures": ["Gemma3ForCausalLM"], "rope_parameters": by_type,
                                    "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]})
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)  # theta 1e6 no longer read as 1e4
    with pytest.raises(ValueError, match="hidden_act 'silu' for Gemma3ForCausalLM"):
        ModelConfig.from_dict({**TINY, "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "silu"})


def test_vision_gemma3_is_refused_with_its_reason():
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration: Gemma 3 with its vision tower"):
        ModelConfig.from_dict({**TINY, "architectures": ["Gemma3ForConditionalGeneration"]})

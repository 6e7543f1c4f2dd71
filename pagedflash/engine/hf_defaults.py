"""What a key a Hugging Face config leaves out means, per family: the default of the family's
transformers config class, and the family's own ways of completing RoPE keys (:func:`complete`).

The values are transformers 5.25's, copied: the engine does not import transformers.
``tests/test_config_defaults.py`` checks every family against the installed transformers (a config of
the required keys only against ``AutoConfig.for_model``, RoPE frequencies from transformers' own
rotary module), so a version that changes a default fails there by family and key.

:data:`DEFAULTS` holds each family's keys over :data:`BASE_DEFAULTS` (LlamaConfig's). ``None``: derived
(``num_key_value_heads``: ``num_attention_heads``; ``head_dim``: ``hidden_size // num_attention_heads``)
or off (``sliding_window``, softcaps).
"""

from __future__ import annotations

BASE_DEFAULTS = {
    "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "hidden_act": "silu", "sliding_window": None, "initializer_range": 0.02,
}
_QWEN_WINDOW = {"sliding_window": 4096, "use_sliding_window": False}  # a window only with use_sliding_window
_GEMMA_DEFAULTS = {"num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True,
                   "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096}
DEFAULTS = {
    "llama": {},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "max_window_layers": 28, **_QWEN_WINDOW},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768, "max_window_layers": 28,
              **_QWEN_WINDOW},
    "granite": {"embedding_multiplier": 1.0, "attention_multiplier": 1.0, "residual_multiplier": 1.0,
                "logits_scaling": 1.0},
    "olmo2": {"rms_norm_eps": 1e-5},
    "gemma2": {**_GEMMA_DEFAULTS, "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "gemma3": {**_GEMMA_DEFAULTS, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
               "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
               "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "phi3": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "mixtral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_theta": 1000000.0, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_key_value_heads": 16, "max_position_embeddings": 32768, "max_window_layers": 28,
                  "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "qkv_bias": True, **_QWEN_WINDOW},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, **_QWEN_WINDOW},
    "olmoe": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "num_experts": 64, "num_experts_per_tok": 8,
              "norm_topk_prob": False},
    "granitemoe": {"embedding_multiplier": 1.0, "attention_multiplier": 1.0, "residual_multiplier": 1.0,
                   "logits_scaling": 1.0, "num_local_experts": 8, "num_experts_per_tok": 2},
    "gpt_oss": {"num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_theta": 150000.0, "sliding_window": 128, "attention_bias": True, "num_local_experts": 128,
                "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
}
# GPT-OSS's RoPE where a config gives neither rope_parameters nor rope_scaling
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
# the families whose transformers model reads these keys (elsewhere a key is ignored, as transformers
# ignores it: a bias tensor it would leave unused then fails strict loading by name)
READS_ATTENTION_BIAS = ("llama", "qwen3", "granite", "olmo2", "gemma2", "gemma3", "qwen3_moe", "olmoe", "granitemoe",
                        "gpt_oss")
READS_MLP_BIAS = ("llama", "granite")
READS_LAYER_TYPES = ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3", "gpt_oss")  # elsewhere a window is on every layer
# one key under two names (transformers' attribute_map)
_EXPERTS_ALIAS = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}


def complete(d: dict, kind: str) -> dict:
    """``d`` (HF keys of a family-``kind`` config) as transformers completes it: every key of
    :func:`with_defaults`, GPT-OSS's YaRN (:data:`GPT_OSS_ROPE`) where neither ``rope_parameters`` nor
    ``rope_scaling`` is given, Gemma 3's RoPE keyed by layer type, Phi-3's ``yarn`` named ``longrope``."""
    d = with_defaults(d, kind)
    if kind == "gpt_oss" and not d.get("rope_parameters") and not d.get("rope_scaling"):
        d = {**d, "rope_scaling": GPT_OSS_ROPE}
    if kind == "gemma3":
        d = _gemma3_rope(d)
    if kind == "phi3":
        d = _phi3_rope(d)
    return d



def with_defaults(d: dict, kind: str) -> dict:
    """``d`` completed with family ``kind``'s defaults (:data:`BASE_DEFAULTS`, :data:`DEFAULTS`) for the
    keys it leaves out; a key given as ``None`` stays ``None``, as transformers keeps it. The experts'
    count is one key under two names (``num_experts``, ``num_local_experts``): either one counts as given."""
    out = dict(d)
    for key, value in {**BASE_DEFAULTS, **DEFAULTS[kind]}.items():
        if key not in d and _EXPERTS_ALIAS.get(key) not in d:
            out[key] = value
    return out


def _gemma3_rope(d: dict) -> dict:
    """``d`` with Gemma 3's RoPE as transformers reads it, keyed by layer type: ``rope_parameters`` by
    type (a type left out: the default RoPE) or the older ``rope_theta`` / ``rope_scaling``, the
    scaling applying to the global layers; a theta left out: ``rope_theta`` for the global layers,
    ``rope_local_base_freq`` for the sliding ones (:data:`DEFAULTS`: 1e6 and 1e4). A single, unkeyed
    ``rope_parameters`` is refused (transformers 5 ignores its values)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ValueError(f"config.json: {key} must be an object, got {value!r}")
    if set(params) - {"full_attention", "sliding_attention"} or \
            any(v is not None and not isinstance(v, dict) for v in params.values()):
        raise ValueError("config.json: Gemma3ForCausalLM's rope_parameters must be keyed by layer type "
                         f"('full_attention', 'sliding_attention'), got {params!r}")
    if any(isinstance(v, dict) for v in scaling.values()):
        raise ValueError(f"config.json: rope_scaling must be one RoPE scaling (the global layers'), got {scaling!r}")
    full = {**(params.get("full_attention") or {}), **scaling}  # no rope_type: the default RoPE
    local = dict(params.get("sliding_attention") or {})
    full.setdefault("rope_theta", d["rope_theta"])
    local.setdefault("rope_theta", d["rope_local_base_freq"])
    return {**d, "rope_parameters": {"full_attention": full, "sliding_attention": local}, "rope_scaling": None}


def _phi3_rope(d: dict) -> dict:
    """``d`` with a Phi-3 ``yarn`` scaling named ``longrope``, as transformers reads it for Phi-3 (an
    early name of longrope there, as ``su``)."""
    out = dict(d)
    for key in ("rope_scaling", "rope_parameters"):
        value = d.get(key)
        if isinstance(value, dict) and value.get("rope_type", value.get("type")) == "yarn":
            out[key] = {**value, "rope_type": "longrope"}
    return out

"""Named model shapes (published configs, HF keys) that ``bench serve --shape`` builds in memory and
``tools/random_model.py --shape`` writes as a checkpoint: one table for both.

- ``llama-3.2-1b`` (``bench serve``'s default model), ``llama-3-8b``, ``gemma-2-2b``, ``qwen3-1.7b``
  (from :mod:`pagedflash.engine.config`);
- ``qwen3-30b-a3b``: Qwen/Qwen3-30B-A3B's config.json (48 layers, hidden 2048, 32/4 heads of 128,
  128 experts of 768, top 8 renormalized, vocab 151936, untied): 30.5 B parameters, 3.3 B active;
- ``qwen1.5-moe-a2.7b``: Qwen/Qwen1.5-MoE-A2.7B's config.json (24 layers, hidden 2048, 16/16 heads of
  128 with q/k/v biases, 60 experts of 1408, top 4 not renormalized, a shared expert of 5632 gated
  per token, vocab 151936, untied): 14.3 B parameters, 2.7 B active;
- ``olmoe-1b-7b``: allenai/OLMoE-1B-7B-0924's config.json (16 layers, hidden 2048, 16/16 heads of 128
  with RMSNorm over the whole q and k projections, 64 experts of 1024, top 8 not renormalized, vocab
  50304, untied): 6.9 B parameters, 1.3 B active;
- ``gpt-oss-20b``: openai/gpt-oss-20b's config.json (24 layers, hidden 2880, 64/8 heads of 64, 32
  experts of 2880, top 4, attention biases and sinks, a 128-token window on alternate layers, YaRN
  x32 over 4096, vocab 201088, untied) without its ``quantization_config``: random experts are bf16,
  as the engine holds MXFP4 ones after dequantizing them at load. 20.9 B parameters, 4.2 B active;
- ``tiny``: a 2-layer Llama (:data:`~pagedflash.engine.config.TINY_LLAMA`).

:func:`tiny` keeps a shape's family and switches at ``tiny``'s sizes (the CPU runs it in seconds);
:func:`write_random_model` saves a shape's random weights through transformers' own class.
"""

from __future__ import annotations

import torch

from pagedflash.bench.common import free_memory
from pagedflash.engine.config import GEMMA_2_2B, LLAMA_3_2_1B, LLAMA_3_8B, QWEN3_1_7B, TINY_LLAMA

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "max_window_layers": 48,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False,
    "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
QWEN1_5_MOE_A2_7B = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "max_position_embeddings": 8192,
    "max_window_layers": 21, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False,
    "sliding_window": 32768, "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 151643,
    "eos_token_id": 151643,
}
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
    "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": False, "clip_qkv": None,
    "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 50279, "pad_token_id": 1,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True,
    "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "swiglu_limit": 7.0, "hidden_act": "silu", "tie_word_embeddings": False, "eos_token_id": 200002,
    "pad_token_id": 199999,
}
SHAPES = {"tiny": TINY_LLAMA, "llama-3.2-1b": LLAMA_3_2_1B, "llama-3-8b": LLAMA_3_8B, "gemma-2-2b": GEMMA_2_2B,
          "qwen3-1.7b": QWEN3_1_7B, "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen1.5-moe-a2.7b": QWEN1_5_MOE_A2_7B,
          "olmoe-1b-7b": OLMOE_1B_7B, "gpt-oss-20b": GPT_OSS_20B}
TINY_WINDOW = 16
TINY_EXPERTS = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}


def tiny(cfg: dict) -> dict:
    """``cfg``'s family and switches at :data:`TINY_LLAMA`'s sizes: a sliding window of
    :data:`TINY_WINDOW`, ``layer_types`` cut to the layers kept, Gemma's query scale at the head dim
    as the real ones have it, a mixture of experts' counts and sizes from :data:`TINY_EXPERTS`, token
    ids past the small vocabulary replaced by ``tiny``'s BOS 1 and EOS 2."""
    out = {**cfg, **{k: v for k, v in TINY_LLAMA.items() if k not in ("architectures", "model_type", "eos_token_id")}}
    out.update({k: v for k, v in TINY_EXPERTS.items() if k in cfg})
    if out.get("sliding_window"):
        out["sliding_window"] = TINY_WINDOW
    if out.get("layer_types"):
        out["layer_types"] = list(out["layer_types"][: out["num_hidden_layers"]])
    if out.get("max_window_layers"):
        out["max_window_layers"] = out["num_hidden_layers"]
    if "query_pre_attn_scalar" in out:
        out["query_pre_attn_scalar"] = out["head_dim"]
    for key, small in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 0)):
        if isinstance(out.get(key), int) and out[key] >= out["vocab_size"]:
            out[key] = small
    out.setdefault("eos_token_id", 2)
    return out


def shape_config(name: str, *, small: bool = False) -> dict:
    """The config of shape ``name`` (:data:`SHAPES`), at :func:`tiny`'s sizes with ``small``."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {name!r}")
    return tiny(SHAPES[name]) if small else dict(SHAPES[name])


def write_random_model(cfg: dict, path: str, on_gpu: bool, seed: int) -> str:
    """Random weights saved as safetensors by transformers' own class for ``cfg``'s architecture
    (its config class and init; bf16 on the GPU, fp32 on the CPU): a directory laid out as a real
    checkpoint of that family, which the engine and transformers both load."""
    import transformers

    arch = cfg["architectures"][0]
    hf_cfg = transformers.AutoConfig.for_model(
        cfg["model_type"], **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    hf_cfg.architectures = [arch]
    torch.manual_seed(seed)
    dev = "cuda" if on_gpu else "cpu"
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16 if on_gpu else torch.float32)
    if type(model).__name__ != arch:
        raise ValueError(f"architectures {cfg['architectures']!r}: transformers built {type(model).__name__} "
                         f"for model_type {cfg['model_type']!r}")
    model.to(dev).save_pretrained(path)
    del model
    free_memory()
    return path

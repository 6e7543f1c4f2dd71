"""Engine building blocks: config parsing (RoPE spellings, llama3 scaling), weight loading (sharded,
clear errors) and seeded random weights."""

import json

import pytest
import torch

from pagedflash.engine import LLM, ModelConfig, SamplingParams

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def fp32_llm(model, **kwargs):
    """The engine in fp32 (on a GPU these tests run there, compiled)."""
    return LLM(model, dtype=torch.float32, **kwargs)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def test_llama3_rope_and_prefill_logits_match_transformers(tmp_path):
    cfg = transformers.LlamaConfig(**TINY, rope_scaling=LLAMA3, rope_theta=500000.0)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_theta == 500000.0
    hf_inv = hf.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(config.inv_freq(), hf_inv, rtol=1e-6, atol=0)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (200, 7)]
    llm = fp32_llm(tmp_path, page_size=16, num_blocks=32)
    with torch.no_grad():
        for p, got in zip(prompts, llm.prompt_logits(prompts)):
            torch.testing.assert_close(got.cpu(), hf(torch.tensor([p])).logits[0], rtol=1e-4, atol=1e-4)


def test_llama_with_attention_and_mlp_bias(tmp_path):
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    prompt = torch.randint(0, 128, (21,)).tolist()
    got = fp32_llm(tmp_path, num_blocks=8).prompt_logits([prompt])[0]
    with torch.no_grad():
        torch.testing.assert_close(got.cpu(), hf(torch.tensor([prompt])).logits[0], rtol=1e-4, atol=1e-4)


def test_old_style_rope_keys_and_unsupported_rope():
    base = {**TINY, "architectures": ["LlamaForCausalLM"]}
    old = ModelConfig.from_dict({**base, "rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope_theta == 1234.0 and old.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    with pytest.raises(ValueError, match="dynamic"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})


def test_qwen2_sliding_window_only_from_max_window_layers(tmp_path):
    """Qwen2 slides only in layers >= max_window_layers (transformers' layer_types); the engine used
    to apply the window to every layer, and its logits drifted once the prompt outgrew the window."""
    torch.manual_seed(6)
    cfg = transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    assert [config.is_sliding(i) for i in range(2)] == [False, True]
    prompt = torch.randint(0, 128, (23,)).tolist()
    got = fp32_llm(tmp_path, page_size=8, num_blocks=8).prompt_logits([prompt])[0]
    with torch.no_grad():
        torch.testing.assert_close(got.cpu(), hf(torch.tensor([prompt])).logits[0], rtol=1e-4, atol=1e-4)
    base = {**TINY, "architectures": ["MistralForCausalLM"], "sliding_window": 5}
    assert ModelConfig.from_dict(base).is_sliding(1)  # Mistral: every layer
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict({**base, "layer_types": ["full_attention", "chunked_attention"]})


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    got = fp32_llm(tmp_path, num_blocks=8).prompt_logits([prompt])[0]
    with torch.no_grad():
        torch.testing.assert_close(got.cpu(), hf(torch.tensor([prompt])).logits[0], rtol=1e-4, atol=1e-4)


def test_random_weights_from_config_are_seeded():
    cfg = transformers.Qwen2Config(**TINY)
    a = fp32_llm(cfg, num_blocks=8, seed=3).prompt_logits([[1, 2, 3]])[0]
    b = fp32_llm(cfg, num_blocks=8, seed=3).prompt_logits([[1, 2, 3]])[0]
    c = fp32_llm(cfg, num_blocks=8, seed=4).prompt_logits([[1, 2, 3]])[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def _save(tmp_path, **overrides):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, **overrides))
    hf.save_pretrained(tmp_path)
    return hf


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        fp32_llm(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fp32_llm(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        fp32_llm(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        fp32_llm(tmp_path)


def test_missing_and_misshaped_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    _save(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    good = dict(tensors)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        fp32_llm(tmp_path, num_blocks=8)
    good["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(good, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        fp32_llm(tmp_path, num_blocks=8)
    file.unlink()
    with pytest.raises(ValueError, match="safetensors"):
        fp32_llm(tmp_path, num_blocks=8)


def test_engine_argument_errors(tmp_path):
    cfg = transformers.LlamaConfig(**TINY)
    for kwargs, field in [(dict(page_size=0), "page_size"), (dict(num_blocks=-1), "num_blocks"),
                          (dict(max_num_seqs=0), "max_num_seqs"), (dict(dtype="int8"), "dtype"),
                          (dict(max_model_len=0), "max_model_len")]:  # 0 used to mean "the default"
        with pytest.raises(ValueError, match=field):
            LLM(cfg, **kwargs)


def test_gpu_model_path_under_interpreter(tmp_path, monkeypatch):
    """The model with the kernels of pagedflash.ops (the GPU path, minus CUDA graphs) against
    transformers; the kernels themselves are checked in test_ops_layers.py."""
    from pagedflash.engine import layers

    monkeypatch.setattr(layers, "FORCE_KERNELS", True)
    torch.manual_seed(2)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)).eval()
    hf.save_pretrained(tmp_path)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (19, 4)]
    llm = fp32_llm(tmp_path, page_size=8, num_blocks=16, max_num_batched_tokens=16)
    with torch.no_grad():
        for p, got in zip(prompts, llm.prompt_logits(prompts)):
            torch.testing.assert_close(got.cpu(), hf(torch.tensor([p])).logits[0], rtol=1e-4, atol=1e-4)
    # one sequence decodes alone: single-row steps take the fused projections (gemv) and argmax
    kernel_tokens = llm.generate([prompts[0]], SamplingParams(max_tokens=5))[0].token_ids
    monkeypatch.setattr(layers, "FORCE_KERNELS", False)
    assert kernel_tokens == llm.generate([prompts[0]], SamplingParams(max_tokens=5))[0].token_ids


def test_llama_ignores_sliding_window_and_head_dim_is_checked():
    base = {**TINY, "architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_dict({**base, "sliding_window": 8}).sliding_window is None  # as transformers' Llama
    with pytest.raises(ValueError, match=r"head_dim=8 is outside the attention kernels' range \[16, 256\]"):
        ModelConfig.from_dict({**base, "head_dim": 8})

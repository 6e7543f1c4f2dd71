"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE, GPT-OSS) against transformers' own classes: a
tiny random model (2 layers, 4 experts of which 2 per token, fp32, eager attention) saved with
``save_pretrained``, its norms, biases and sinks perturbed so that they matter. Prompt logits and
greedy tokens (chunked prefill, paged decode) must equal transformers'; GPT-OSS's prompts are longer
than its window; one family on two ranks (gloo); configs the engine does not implement refused by name."""

import json

import pytest
import torch
from helpers import ON_GPU, TWO_GPUS, hf_greedy, prompts_of

from pagedflash.engine import LLM, ModelConfig, SamplingParams

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1, num_experts_per_tok=2)

# family -> (config class, model class, config overrides)
MOE_CASES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, sliding_window=7)),
    # layer 0 dense (mlp_only_layers), top-k weights not renormalized (Mixtral's are)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[0])),
    # a shared expert (wider than the routed ones) beside them; layer 1 dense (decoder_sparse_step 1 and
    # mlp_only_layers), top-k renormalized; q/k/v biases; a 6-token window on layer 0
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       norm_topk_prob=True, mlp_only_layers=[1], use_sliding_window=True, sliding_window=6,
                       max_window_layers=2)),
    # RMSNorm over the whole q and k projections, top-k not renormalized
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, norm_topk_prob=False)),
    # Granite's multipliers; the top-k logits then softmax; experts fused in the checkpoint, narrower
    # than the hidden size; tied embeddings and attention biases (as the released models, the first)
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=4, intermediate_size=48, embedding_multiplier=2.0, attention_multiplier=0.2,
        residual_multiplier=0.6, logits_scaling=3.0, tie_word_embeddings=True, attention_bias=True)),
    # a 5-token window on layer 0; YaRN (transformers' default for GPT-OSS) over a short original context
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=4, sliding_window=5, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})),
}


def save_moe(path, family, seed=0, **extra):
    """A tiny random transformers model of ``family`` saved to ``path``; returns it (eval, fp32)."""
    cfg_name, model_name, overrides = MOE_CASES[family]
    cfg = getattr(transformers, cfg_name)(**{**TINY, **overrides, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    if family == "gpt_oss":  # transformers before ~5.2x hard-codes alpha 1.702 and limit 7.0; later ones read the config
        for layer in model.model.layers:
            layer.mlp.experts.alpha = getattr(cfg, "swiglu_alpha", 1.702)
            layer.mlp.experts.limit = cfg.swiglu_limit
    with torch.no_grad():  # norms start at one, biases at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias", "sinks")):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    return model


def check_against_transformers(llm, hf, prompts, n=4):
    with torch.no_grad():
        for p, got in zip(prompts, llm.prompt_logits(prompts)):
            torch.testing.assert_close(got.cpu(), hf(torch.tensor([p])).logits[0], rtol=1e-4, atol=1e-4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, n) for p in prompts]


@pytest.mark.parametrize("family", list(MOE_CASES))
def test_moe_family_matches_transformers(tmp_path, family):
    hf = save_moe(tmp_path, family)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.family == family and config.num_experts == 4
    assert config.dense_layers == {"qwen3_moe": (0,), "qwen2_moe": (1,)}.get(family, ())
    assert config.num_parameters() == sum(p.numel() for p in hf.parameters())  # built on the meta device
    experts = [m for m in hf.modules() if type(m).__name__.endswith("Experts")]  # the 2 of 4 a token reads
    assert config.num_active_parameters() == config.num_parameters() - sum(
        p.numel() for m in experts for p in m.parameters()) // 2
    # chunked prefill (8-token chunks), prompts longer than the windows, small pages
    llm = LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=48, max_num_batched_tokens=8)
    check_against_transformers(llm, hf, prompts_of([13, 5], seed=3, low=3))


def test_yarn_tables_equal_transformers(tmp_path):
    """YaRN's inverse frequencies and attention factor as transformers computes them, truncated or not."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate in (False, True):
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": truncate, "original_max_position_embeddings": 64}
        hf_cfg = transformers.GptOssConfig(**{**TINY, "num_local_experts": 4, "rope_parameters": rope})
        inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
        config = ModelConfig.from_hf_config(hf_cfg)
        torch.testing.assert_close(config.inv_freq(), inv, rtol=0, atol=0)
        assert config.rope_attention_factor() == pytest.approx(factor)


def test_qwen3_moe_dense_layers():
    """Qwen3-MoE's dense layers as transformers picks them: ``mlp_only_layers``, and the layers ``l``
    with ``(l + 1) % decoder_sparse_step != 0``."""
    base = {**TINY, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
            "moe_intermediate_size": 32, "num_hidden_layers": 6}
    assert ModelConfig.from_dict({**base, "decoder_sparse_step": 2}).dense_layers == (0, 2, 4)
    config = ModelConfig.from_dict({**base, "decoder_sparse_step": 3, "mlp_only_layers": [5]})
    assert config.dense_layers == (0, 1, 3, 4, 5) and [config.is_moe(i) for i in (2, 5)] == [True, False]
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_dict({**base, "mlp_only_layers": [6]})


@pytest.mark.skipif(ON_GPU and not TWO_GPUS, reason="needs 2 GPUs (without a GPU: gloo on the CPU)")
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe"])
def test_two_ranks_match_transformers(tmp_path, family):
    """Two ranks (gloo on the CPU): each expert's intermediate rows split; GPT-OSS: its interleaved
    gate/up de-interleaved per rank, sinks per rank's heads, the experts' down bias added once;
    Qwen3-MoE: per-expert tensors, q/k norms, a dense layer beside the experts; Qwen2-MoE: the shared
    expert's rows split, its gate whole; OLMoE: the q/k projection norms summed over the ranks;
    Granite-MoE: each rank's rows of the checkpoint's fused gate/up and columns of its down."""
    hf = save_moe(tmp_path, family)
    with LLM(tmp_path, tensor_parallel_size=2, device="cuda" if ON_GPU else "cpu", dtype=torch.float32,
             page_size=4, num_blocks=24) as llm:
        assert llm.model.shard.moe_intermediate_size == hf.config.to_dict().get(
            "moe_intermediate_size", hf.config.intermediate_size) // 2
        assert llm.model.shard.shared_expert_intermediate_size == hf.config.to_dict().get(
            "shared_expert_intermediate_size", 0) // 2
        check_against_transformers(llm, hf, prompts_of([11, 5], seed=4, low=3), n=3)


def save_mxfp4(path, seed=0, **extra):
    """A tiny GPT-OSS whose experts are random MXFP4 blocks and scales, saved as GPT-OSS's quantized
    checkpoints are (``*_blocks`` / ``*_scales``, ``quantization_config``); returns transformers' model
    holding them dequantized by transformers' own ``convert_moe_packed_tensors``."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = save_moe(path, "gpt_oss", seed=seed, **extra)
    cfg = hf.config
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(path / "model.safetensors")
    for layer in range(cfg.num_hidden_layers):
        experts = hf.model.layers[layer].mlp.experts
        for proj, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(121, 124, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
            getattr(experts, proj).data = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            del tensors[name]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _edit_config(path, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return hf


@pytest.mark.skipif(ON_GPU and not TWO_GPUS, reason="needs 2 GPUs (without a GPU: gloo on the CPU)")
def test_mxfp4_experts_dequantized_at_load(tmp_path):
    """GPT-OSS's MXFP4 experts dequantized at load as transformers does, on two ranks: each rank's
    interleaved gate/up rows of the blocks, and the down blocks holding its 48 columns of 96 (rank 1
    starts 16 columns into a block)."""
    hf = save_mxfp4(tmp_path, intermediate_size=96)
    assert ModelConfig.from_pretrained(tmp_path).moe_quant == "mxfp4"
    with LLM(tmp_path, tensor_parallel_size=2, device="cuda" if ON_GPU else "cpu", dtype=torch.float32,
             page_size=4, num_blocks=24) as llm:
        check_against_transformers(llm, hf, prompts_of([9, 4], seed=6, low=3), n=3)


def _edit_config(path, **changes):
    cfg_file = path / "config.json"
    d = json.loads(cfg_file.read_text())
    d.update(changes)
    cfg_file.write_text(json.dumps(d))


@pytest.mark.parametrize("family, changes, match", [
    # a Qwen3-MoE checkpoint relabelled as dense Qwen3: its experts are math Qwen3 does not do
    ("qwen3_moe", dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"), "num_local_experts=4"),
    ("qwen3_moe", dict(architectures=["MixtralForCausalLM"]), "model_type='qwen3_moe'"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=32), "shared_expert_intermediate_size=32"),
    ("mixtral", dict(routed_scaling_factor=2.5), "routed_scaling_factor=2.5"),
    ("gpt_oss", dict(quantization_config={"quant_method": "bitsandbytes"}), "quant_method='bitsandbytes'"),
    ("gpt_oss", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic'"),
    ("mixtral", dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size must be a positive int"),
    # transformers' Granite-MoE has no num_experts alias: it would build num_local_experts' experts
    ("granitemoe", dict(num_experts=8), "num_experts=8"),
    ("granitemoe", dict(architectures=["GraniteMoeHybridForCausalLM"]), "hybrid Mamba"),
])
def test_unsupported_configs_refused_by_name(tmp_path, family, changes, match):
    save_moe(tmp_path, family)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=8)


def test_shared_expert_split_checked():
    """Two ranks need the shared expert's rows to split evenly too."""
    from pagedflash.engine.parallel import check_tensor_parallel_size

    config = ModelConfig.from_dict({**TINY, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                                    "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 50})
    assert check_tensor_parallel_size(config, 2, torch.device("cpu")) == 2
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        check_tensor_parallel_size(config, 4, torch.device("cpu"))


def test_relabelled_checkpoint_refused_by_tensor(tmp_path):
    """A Qwen3-MoE checkpoint whose config is rewritten as Mixtral's: its expert tensors are not
    Mixtral's, and the load names them."""
    save_moe(tmp_path, "qwen3_moe", moe_intermediate_size=64)
    _edit_config(tmp_path, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4)
    with pytest.raises(ValueError, match="does not use: .*(gate_proj|up_proj|down_proj|q_norm|k_norm)"):
        LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=8)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen2_moe"])
def test_kernel_path_matches_transformers(tmp_path, monkeypatch, family):
    """The GPU path under the interpreter: pagedflash.ops.moe's route and fused_moe, and at batch 1 the
    fused single-row projections; GPT-OSS: the clamped SwiGLU with biases, sinks in the attention
    kernels, the router's bias; Qwen2-MoE: the shared expert and its one-column gate."""
    from pagedflash.engine import layers

    monkeypatch.setattr(layers, "FORCE_KERNELS", True)
    hf = save_moe(tmp_path, family, seed=1)
    llm = LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16)
    prompt = prompts_of([7], seed=5, low=3)[0]  # longer than the window
    check_against_transformers(llm, hf, [prompt], n=3)


def random_shards(config):
    """``(rank, layer, whole_layer)`` for each layer of each of two ranks' models with seed-3 random
    weights, beside the same layer of the one-rank model."""
    from pagedflash.engine.parallel import Collectives, ShardSizes
    from pagedflash.engine.weights import build_model, init_random_weights

    kw = dict(max_len=32, dtype=torch.float32, device=torch.device("cpu"))
    whole = build_model(config, **kw)
    init_random_weights(whole, seed=3)
    for rank in range(2):
        part = build_model(config, shard=ShardSizes.of(config, rank, 2), comm=Collectives(2), **kw)
        init_random_weights(part, seed=3)
        for layer, one in zip(part.model.layers, whole.model.layers):
            yield rank, layer, one


def test_random_experts_shard_as_one_rank():
    """Random weights (the benchmarks' models) on two ranks are the one-rank model's: each rank's
    w13 holds its rows of every expert's gate and of its up, w2 those columns, sinks its heads."""
    config = ModelConfig.from_dict({**TINY, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                                    "num_local_experts": 4, "sliding_window": 5})
    i = config.moe_intermediate_size // 2
    for rank, layer, one in random_shards(config):
        rows = slice(rank * i, (rank + 1) * i)
        gate, up = one.mlp.experts.w13.chunk(2, dim=1)
        assert torch.equal(layer.mlp.experts.w13, torch.cat([gate[:, rows], up[:, rows]], dim=1))
        assert torch.equal(layer.mlp.experts.w2, one.mlp.experts.w2[:, :, rows])
        assert torch.equal(layer.mlp.router.weight, one.mlp.router.weight)
        assert torch.equal(layer.self_attn.sinks, one.self_attn.sinks[rank * 2 : rank * 2 + 2])


def test_random_shared_expert_shards_as_one_rank():
    """Qwen2-MoE's shared expert drawn at random on two ranks is the one-rank model's: each rank's
    gate/up rows and down columns, the router with the shared expert's gate whole."""
    config = ModelConfig.from_dict({**TINY, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                                    "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48})
    i = config.shared_expert_intermediate_size // 2
    for rank, layer, one in random_shards(config):
        rows = slice(rank * i, (rank + 1) * i)
        gate, up = one.mlp.shared_expert.gate_up_proj.weight.chunk(2)
        assert torch.equal(layer.mlp.shared_expert.gate_up_proj.weight, torch.cat([gate[rows], up[rows]]))
        assert torch.equal(layer.mlp.shared_expert.down_proj.weight, one.mlp.shared_expert.down_proj.weight[:, rows])
        assert torch.equal(layer.mlp.gate.weight, one.mlp.gate.weight)  # the router, the shared gate last

"""Each decoder family of :mod:`pagedflash.engine.models` against transformers' own class: a tiny
random model (2 layers, fp32, eager attention) saved with ``save_pretrained``, its norms and biases
perturbed so that they matter, windows shorter than the prompts. Prompt logits and greedy tokens
(through chunked prefill, paged decode and prefix-cache hits) must equal transformers', on one rank and (the families
whose weights shard in their own way: OLMo 2's q/k norms, Phi-3's fused tensors) on two; and with a
config.json that leaves out every key but the required ones (the engine's defaults: transformers')."""

import copy
import json
import os

import pytest
import torch
from helpers import ON_GPU, TWO_GPUS, hf_greedy, prompts_of

from pagedflash.engine import LLM, ModelConfig, SamplingParams
from pagedflash.engine.config import FAMILIES
from pagedflash.engine.models import MODELS
from pagedflash.engine.runner import ModelRunner

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)

# family -> (config class, model class, config overrides)
FAMILY_CASES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=3.0, attention_multiplier=0.15, residual_multiplier=0.6, logits_scaling=2.5)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=5, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=5)),
    # every prompt longer than original_max_position_embeddings: transformers takes the long factors
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        original_max_position_embeddings=4,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.6, 2, 2.5, 3, 4],
                         "long_factor": [1.0, 1.5, 2, 3, 4, 6, 8, 12]})),
    # partial rotary (Phi-4-mini: 0.75): the first head_dim * factor dims of each head rotated
    "phi3-partial": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=5, partial_rotary_factor=0.5)),
    "phi3-partial-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        original_max_position_embeddings=4,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2, 2.5], "long_factor": [1.0, 1.5, 2, 3, 4, 6]})),
}


# the keys the engine requires of a config (every other one means what transformers makes of it)
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def save_family(path, family, seed=0, minimal=False, **extra):
    """A tiny random transformers model of ``family`` saved to ``path``; returns it (eval, fp32).
    ``minimal``: built from TINY's required keys and ``extra`` alone (every other key transformers'
    default) and saved with a config.json holding only those and the architecture."""
    cfg_name, model_name, overrides = FAMILY_CASES[family]
    kwargs = {**{k: TINY[k] for k in REQUIRED_KEYS}, **extra} if minimal else {**TINY, **overrides, **extra}
    cfg = getattr(transformers, cfg_name)(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # norms start at one (Gemma: zero) and biases at zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    if minimal:
        cfg_file = os.path.join(path, "config.json")
        with open(cfg_file) as f:
            saved = json.load(f)
        keep = {*kwargs, "architectures", "model_type", "dtype", "torch_dtype", "transformers_version"}
        with open(cfg_file, "w") as f:
            json.dump({k: v for k, v in saved.items() if k in keep}, f)
    return model


def test_every_architecture_has_a_model_class():
    assert set(MODELS) == set(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_every_family_builds_under_another_device(tmp_path, family):
    """The model builds under a device context other than the CPU (the meta device here, as
    ``num_parameters`` builds it; a GPU when serving): RoPE tables made on the CPU whatever device
    is current (longrope's factor tensor followed the context and failed the build on the GPU)."""
    save_family(tmp_path, family)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.num_parameters() > 0
    with torch.device("meta"):
        assert config.inv_freq(max_len=64).device.type == "cpu"


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_family_matches_transformers(tmp_path, family):
    hf = save_family(tmp_path, family)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.family == family.split("-")[0]
    # chunked prefill (8-token chunks), prompts longer than every window, small pages
    llm = LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=48, max_num_batched_tokens=8)
    assert_matches_transformers(llm, hf)


def assert_matches_transformers(llm, hf, lengths=(19, 6), prefix_cache=True):
    """Prompt logits and greedy tokens of prompts of ``lengths``, then (``prefix_cache``) greedy
    tokens again with the first pages from the prefix cache."""
    prompts = prompts_of(lengths, seed=3, low=3)
    with torch.no_grad():
        for p, got in zip(prompts, llm.prompt_logits(prompts)):
            torch.testing.assert_close(got.cpu(), hf(torch.tensor([p])).logits[0], rtol=1e-4, atol=1e-4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in prompts]
    if not prefix_cache:
        return
    longer = prompts[0] + outs[0].token_ids  # its first pages from the prefix cache
    again = llm.generate([longer], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert llm.last_stats["prefix_cache_hit_rate"] > 0 and again.token_ids == hf_greedy(hf, longer, 2)


@pytest.mark.parametrize("family, layers", [("granite", 2), ("gemma3", 6)])
def test_left_out_keys_match_transformers(tmp_path, monkeypatch, family, layers):
    """A config.json with only the required keys: the engine takes transformers' defaults (Granite's
    attention_multiplier 1.0 as the softmax scale; Gemma 3's head_dim 256, 4 KV heads,
    query_pre_attn_scalar 256, five sliding layers to one global with RoPE thetas 1e4 and 1e6)."""
    # the engine's warm-up on a GPU compiles every chunk length's kernels; fp32 at head_dim 256 takes
    # 6-14 s a kernel to compile, minutes for the whole ladder (docs/performance.md v62): warm up the
    # decode row and the prompt's chunk only (the rest compiles if a step needs it)
    warmup = ModelRunner.warmup
    monkeypatch.setattr(ModelRunner, "warmup", lambda self: warmup(self, lengths=(1, 16)))
    hf = save_family(tmp_path, family, minimal=True, num_hidden_layers=layers, initializer_range=0.1)
    with open(tmp_path / "config.json") as f:
        assert not {"head_dim", "num_key_value_heads", "rope_parameters", "rope_theta"} & set(json.load(f))
    llm = LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=16, max_model_len=64)
    assert_matches_transformers(llm, hf, lengths=(13,), prefix_cache=False)


@pytest.mark.skipif(ON_GPU and not TWO_GPUS, reason="needs 2 GPUs (without a GPU: gloo on the CPU)")
@pytest.mark.parametrize("family, kv_heads", [("olmo2", 1), ("olmo2", 2), ("phi3-partial-longrope", 2)],
                         ids=["olmo2-kv-replicated", "olmo2-kv-split", "phi3-fused-partial-rotary"])
def test_two_ranks_match_transformers(tmp_path, family, kv_heads):
    """Two ranks (gloo on the CPU): OLMo 2's q/k norms over the whole projection sum their mean
    square over the ranks (a replicated KV head counted once), Phi-3's fused tensors split per part
    (with partial rotary and longrope: every rank rotates the first rotary_dim dims of its heads)."""
    hf = save_family(tmp_path, family, num_key_value_heads=kv_heads)
    prompts = prompts_of([11, 5], seed=4, low=3)
    with LLM(tmp_path, tensor_parallel_size=2, device="cuda" if ON_GPU else "cpu", dtype=torch.float32,
             page_size=4, num_blocks=24) as llm:
        assert llm.model.shard.num_kv_heads == 1
        logits = llm.prompt_logits(prompts)
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    with torch.no_grad():
        for p, got in zip(prompts, logits):
            torch.testing.assert_close(got.cpu(), hf(torch.tensor([p])).logits[0], rtol=1e-4, atol=1e-4)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 3) for p in prompts]


@pytest.mark.skipif(not ON_GPU, reason="bf16 kernels need a GPU (the interpreter computes bf16 dots wrongly)")
@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_family_in_bf16_on_the_gpu(tmp_path, family):
    """The compiled kernels in bf16 with CUDA graphs, as served: prompt logits no further from
    transformers' fp32 model than transformers' own model cast to bf16 is (twice its error, plus 1 %
    of the logits' range), and greedy decoding through the decode graphs runs to its length."""
    hf = save_family(tmp_path, family)
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    llm = LLM(tmp_path, dtype=torch.bfloat16, page_size=4, num_blocks=48, max_num_batched_tokens=8)
    prompts = prompts_of([19, 6], seed=0, low=3)
    with torch.no_grad():
        for p, got in zip(prompts, llm.prompt_logits(prompts)):
            want = hf(torch.tensor([p])).logits[0]
            own_error = (hf_bf16(torch.tensor([p])).logits[0].float() - want).abs().max()
            error = (got.float().cpu() - want).abs().max()
            assert error <= 2 * own_error + 0.01 * want.abs().max(), (family, error, own_error)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8, 8]


def test_kernel_path_and_decode_graphs_match_transformers(tmp_path, monkeypatch):
    """The GPU path under the interpreter, on Gemma 3 (the family that uses the most of it): the
    kernels of pagedflash.ops (norms on q/k heads, RoPE tables per layer type, the fused single-row
    projections after (1 + w) norms and after the GeGLU) and the decode-graph body (logits softcapped
    into the static buffer), replayed eagerly. Gemma 3's attn_logit_softcapping is ignored, as transformers does."""
    from pagedflash.engine import layers
    from pagedflash.engine import runner as runner_mod

    class EagerReplay:
        def __init__(self, body):
            self.body = body

        def replay(self):
            self.body()

    monkeypatch.setattr(layers, "FORCE_KERNELS", True)
    monkeypatch.setattr(runner_mod, "capture", lambda body, pool: (EagerReplay(body), pool))
    hf = save_family(tmp_path, "gemma3", seed=1, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    llm = LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16)
    llm.runner.capture_graphs()
    prompts = prompts_of([9, 4], seed=5, low=3)
    with torch.no_grad():
        for p, got in zip(prompts, llm.prompt_logits(prompts)):
            torch.testing.assert_close(got.cpu(), hf(torch.tensor([p])).logits[0], rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want = [hf_greedy(hf, p, 3) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.generate([prompts[0]], params)[0].token_ids == want[0]  # batch 1: the fused single-row path


def test_fp8_kv_cache_with_softcap_and_windows(tmp_path):
    """Gemma 2 over an fp8 (e4m3, scale 1) K/V pool: the softcapped, windowed attention reads the
    quantized cache; logits within fp8's rounding of transformers' (3 mantissa bits on K and V)."""
    hf = save_family(tmp_path, "gemma2")
    llm = LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=48, kv_cache_dtype="fp8")
    prompt = prompts_of([19], seed=3, low=3)[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(llm.prompt_logits([prompt])[0].cpu(), want, rtol=0, atol=0.25)

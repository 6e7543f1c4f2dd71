"""``tools/random_model.py``: the directories it writes load in transformers as the shape's own
class and in the engine, with equal greedy tokens (tiny variants of the Gemma-2-2B and Qwen3-1.7B
shapes, a prompt longer than Gemma's window); ``--set`` checks its keys; and ``bench serve``'s
bandwidth bound counts the bytes a decode step reads (a tied LM head once, an untied input
embedding not at all, a sliding-window layer's KV up to its window, a mixture of experts' routed
experts only)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy, prompts_of

from pagedflash.bench.decode_bound import bytes_read, kv_read
from pagedflash.engine import LLM, ModelConfig, SamplingParams
from pagedflash.engine.config import GEMMA_2_2B, LLAMA_3_8B, QWEN3_1_7B
from pagedflash.engine.models import model_class

transformers = pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "random_model", Path(__file__).resolve().parents[1] / "tools" / "random_model.py")
random_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(random_model)


@pytest.mark.parametrize("shape, extra", [("gemma-2-2b", []), ("qwen3-1.7b", ["--set", "num_hidden_layers=3"])])
def test_tiny_family_loads_and_matches_transformers(tmp_path, capsys, shape, extra):
    assert random_model.main([str(tmp_path), "--shape", shape, "--tiny", *extra]) == 0
    assert "(tiny)" in capsys.readouterr().out
    config = ModelConfig.from_pretrained(tmp_path)
    arch = random_model.SHAPES[shape]["architectures"][0]
    assert config.architecture == arch and config.hidden_size == 64 and config.tie_word_embeddings
    if shape == "gemma-2-2b":
        assert (config.sliding_window, config.layer_types) == (16, ("sliding_attention", "full_attention"))
        assert (config.attn_softcap, config.final_softcap, config.attention_scale) == (50.0, 30.0, 0.25)
    else:
        assert (config.num_layers, config.qk_norm, config.rope_theta) == (3, "head", 1e6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    assert type(hf).__name__ == arch
    llm = LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=32)
    prompt = prompts_of([20], seed=1, vocab=config.vocab_size, low=3)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    llm.close()
    with torch.no_grad():
        assert out.token_ids == hf_greedy(hf.eval(), prompt, 3)


def test_set_refuses_unknown_keys_and_bad_items(tmp_path, capsys):
    for item, message in (("nope=1", "'nope' is not a settable field of Qwen3Config"),
                          ("num_hidden_layers", "expected KEY=VALUE, got 'num_hidden_layers'")):
        with pytest.raises(SystemExit):
            random_model.main([str(tmp_path), "--shape", "qwen3-1.7b", "--tiny", "--set", item])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "config.json").exists()


def test_bound_counts_the_bytes_a_decode_step_reads():
    gemma = ModelConfig.from_dict(GEMMA_2_2B)
    weights, kv = bytes_read(gemma, {}, on_gpu=True)
    assert weights == 2 * gemma.num_parameters() == 2 * 2_614_341_888  # tied: the LM head's matrix once
    assert kv == 2 * 4 * 256 * 2  # K and V, 4 heads of 256, bf16, per token and layer
    assert kv_read(gemma, kv, 1000) == kv * 26 * 1000
    assert kv_read(gemma, kv, 8192) == kv * (13 * 4096 + 13 * 8192)  # 13 sliding layers read the window
    qwen = ModelConfig.from_dict(QWEN3_1_7B)
    assert kv_read(qwen, kv, 8192) == kv * 28 * 8192
    llama = ModelConfig.from_dict(LLAMA_3_8B)  # untied: the input embedding's lookup reads a row a token
    weights, kv = bytes_read(llama, {"kv_cache_dtype": "fp8_e4m3"}, on_gpu=True)
    assert weights == 2 * (llama.num_parameters() - 128256 * 4096)
    assert kv == 2 * 8 * 128


def test_bound_counts_the_experts_a_decode_step_routes_to():
    """Batch 1 reads the active parameters (the routed k of E experts per MoE layer); a batch of b rows
    the E(1 - (1 - k/E)^b) experts it reaches under uniform routing; a dense model reads all at any batch."""
    moe = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                                 "vocab_size": 128, "hidden_size": 64, "intermediate_size": 64,
                                 "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 32, "mlp_only_layers": [0], "tie_word_embeddings": True})
    with torch.device("meta"):  # the experts' parameters counted from the engine's own modules
        model = model_class(moe)(moe, 1)
    experts = sum(p.numel() for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] in ("w13", "w2"))
    assert experts == 2 * 4 * 3 * 64 * 32  # two MoE layers of four experts
    total = moe.num_parameters()
    weights = lambda batch: bytes_read(moe, {}, on_gpu=False, batch=batch)[0]  # fp32 on the CPU
    assert weights(1) == 4 * moe.num_active_parameters() == 4 * (total - experts / 2)
    assert weights(2) == 4 * (total - experts / 4)  # each layer misses an expert with probability (1/2)^2
    assert weights(1) < weights(2) < weights(8) < 4 * total == pytest.approx(weights(64))
    llama = ModelConfig.from_dict(LLAMA_3_8B)
    assert bytes_read(llama, {}, on_gpu=True, batch=32) == bytes_read(llama, {}, on_gpu=True)
    with pytest.raises(ValueError, match="batch must be an int >= 1, got 0"):
        bytes_read(moe, {}, on_gpu=True, batch=0)

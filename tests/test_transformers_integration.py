"""``attn_implementation="pagedflash"`` in transformers: logits equal SDPA's (prefill, padded batches,
decode through transformers' own cache)."""

import inspect

import pytest
import torch

import pagedflash.integrations.transformers as pf_hf

transformers = pytest.importorskip("transformers")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"  # pagedflash runs compiled on a GPU, interpreted on a CPU

# transformers renamed the forward's cache argument (`past_key_values` -> `cache`, the old name
# deprecated from 5.2x); the H200 image has an older release than the CPU machines
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else \
    "past_key_values"

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def pair(tmp_path, cls, cfg, dtype=torch.float32, device=DEVICE):
    pf_hf.register()
    torch.manual_seed(0)
    with torch.device(device):
        cls(cfg).to(dtype).save_pretrained(tmp_path)
    load = lambda impl: cls.from_pretrained(tmp_path, attn_implementation=impl, dtype=dtype).to(device).eval()
    return load("pagedflash"), load("sdpa")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return pair(tmp_path_factory.mktemp("hf"), transformers.LlamaForCausalLM, transformers.LlamaConfig(**TINY))


def test_registered():
    pf_hf.register()
    pf_hf.register()  # idempotent
    assert "pagedflash" in transformers.AttentionInterface()
    assert "pagedflash" in transformers.AttentionMaskInterface()


@torch.no_grad()
def test_prefill_logits_match_sdpa(models):
    ours, ref = models
    ids = torch.randint(0, 128, (3, 37), device=DEVICE)
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_left_padded_batch_and_generate(models):
    ours, ref = models
    ids = torch.randint(0, 128, (3, 21), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    real = mask.bool()
    torch.testing.assert_close(ours(ids, attention_mask=mask).logits[real], ref(ids, attention_mask=mask).logits[real],
                               rtol=1e-4, atol=1e-4)
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


@torch.no_grad()
def test_decode_with_cache_matches_sdpa(models):
    ours, ref = models
    ids = torch.randint(0, 128, (2, 15), device=DEVICE)
    out_a = ours(ids, use_cache=True)
    out_b = ref(ids, use_cache=True)
    nxt = out_b.logits[:, -1:].argmax(-1)
    step_a = ours(nxt, **{CACHE_ARG: out_a.past_key_values}, use_cache=True).logits
    step_b = ref(nxt, **{CACHE_ARG: out_b.past_key_values}, use_cache=True).logits
    torch.testing.assert_close(step_a, step_b, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_packed_sequences_by_position_ids(models):
    ours, ref = models
    a, b = torch.randint(0, 128, (1, 9), device=DEVICE), torch.randint(0, 128, (1, 14), device=DEVICE)
    positions = torch.cat([torch.arange(9), torch.arange(14)])[None].to(DEVICE)
    packed = ours(torch.cat([a, b], dim=1), position_ids=positions).logits
    torch.testing.assert_close(packed, torch.cat([ref(a).logits, ref(b).logits], dim=1), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_mistral_sliding_window_matches_sdpa(tmp_path):
    cfg = transformers.MistralConfig(**TINY, sliding_window=6)
    ours, ref = pair(tmp_path, transformers.MistralForCausalLM, cfg)
    ids = torch.randint(0, 128, (2, 19), device=DEVICE)
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@torch.no_grad()
def test_gpu_bf16_1b_logits_close_to_sdpa(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   max_position_embeddings=4096, tie_word_embeddings=True)
    ours, ref = pair(tmp_path, transformers.LlamaForCausalLM, cfg, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 128256, (2, 600), device="cuda")

    def close(a, b):
        a, b = a.float(), b.float()
        assert (a - b).abs().max() < 0.05 * b.abs().max() + 0.05
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8  # random weights: many near-ties

    out_a, out_b = ours(ids, use_cache=True), ref(ids, use_cache=True)
    close(out_a.logits, out_b.logits)
    nxt = out_b.logits[:, -1:].argmax(-1)
    close(ours(nxt, **{CACHE_ARG: out_a.past_key_values}).logits, ref(nxt, **{CACHE_ARG: out_b.past_key_values}).logits)
    gen = ours.generate(ids[:, :100], max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert gen.shape == (2, 116)

"""``attn_implementation="pagedflash"`` in transformers: logits equal eager attention's and SDPA's
(prefill, padded batches, decode through transformers' own cache, softcap, sliding windows both
ways, gpt-oss's attention sinks); keywords that would change the math and are not implemented raise
errors that name them."""

import inspect

import pytest
import torch

import pagedflash.integrations.transformers as pf_hf
from pagedflash.reference import attention_ref

transformers = pytest.importorskip("transformers")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"  # pagedflash runs compiled on a GPU, interpreted on a CPU

# transformers renamed the forward's cache argument (`past_key_values` -> `cache`, the old name
# deprecated from 5.2x); the H200 image has an older release than the CPU machines
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else \
    "past_key_values"

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def pair(tmp_path, cls, cfg, dtype=torch.float32, device=DEVICE, reference="sdpa"):
    pf_hf.register()
    torch.manual_seed(0)
    with torch.device(device):
        cls(cfg).to(dtype).save_pretrained(tmp_path)
    load = lambda impl: cls.from_pretrained(tmp_path, attn_implementation=impl, dtype=dtype).to(device).eval()
    return load("pagedflash"), load(reference)


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


@pytest.mark.parametrize("positions,sequences", [
    ([*range(9), *range(14)], [(0, 9), (9, 23)]),
    ([3, 4, 5, 0, 1, 2], [(0, 3), (3, 6)]),  # a row may start inside a sequence
    ([0, 0, 1, 0], [(0, 1), (1, 3), (3, 4)]),
    (list(range(6)), [(0, 6)]),
], ids=["two", "continued", "three", "one"])
def test_packed_row_cut_by_positions(positions, sequences):
    """A sequence starts at index 0 and wherever a position is 0: eager finds the starts (a dense
    launch for one sequence); the compiled form (_position_segments) has a segment per token, the
    sequence ending there or nothing, and the same non-empty segments."""
    pos = torch.tensor(positions, device=DEVICE)
    n = len(positions)
    cu = pf_hf._position_segments(pos).tolist()
    assert len(cu) == n + 1 and cu[0] == 0 and cu[-1] == n
    assert [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b != a] == sequences
    q = torch.zeros(1, n, 4, 16, device=DEVICE)
    packed = pf_hf._packed_cu_seqlens(q, q, {"position_ids": pos[None]})
    if len(sequences) == 1:
        assert packed is None
    else:
        cu_q, cu_k, max_q, max_k = packed
        assert cu_q.tolist() == cu_k.tolist() == [a for a, _ in sequences] + [n]
        assert max_q == max_k == max(b - a for a, b in sequences)


def _padded_layout_reference(mask, sq):
    """Per row: pad keys before the first real one, real keys, and the same for its last sq positions."""
    rows = []
    for row in mask.tolist():
        lead = next((i for i, real in enumerate(row) if real), len(row))
        q_row = row[-sq:] if sq <= len(row) else [True] * sq
        q_lead = next((i for i, real in enumerate(q_row) if real), sq)
        rows.append((lead, sum(row), q_lead, sum(q_row)))
    return rows


def _mask(sk, *rows):
    """Bool [B, Sk] with each row's real tokens at [start, end)."""
    mask = torch.zeros(len(rows), sk, dtype=torch.bool, device=DEVICE)
    for b, (start, end) in enumerate(rows):
        mask[b, start:end] = True
    return mask


PADDED = {  # (mask, Sq): real tokens contiguous; queries are the last Sq positions
    "left": (_mask(11, (0, 11), (4, 11), (10, 11), (11, 11)), 11),  # all real, mixed, mostly pad, all pad
    "right": (_mask(11, (0, 11), (0, 6), (0, 1)), 11),
    "decode": (_mask(13, (0, 13), (5, 13), (12, 13), (13, 13)), 1),
    "chunk": (_mask(13, (0, 13), (5, 13), (11, 13)), 3),  # a row with fewer real tokens than queries
    "longer_q": (_mask(4, (0, 4), (2, 4), (4, 4)), 6),  # Sq > Sk: every query counts as real
}


@pytest.mark.parametrize("name", list(PADDED))
def test_padded_layout_matches_a_reference(name):
    mask, sq = PADDED[name]
    got = torch.stack(pf_hf._padded_layout(mask, sq), dim=1).tolist()
    assert [tuple(r) for r in got] == _padded_layout_reference(mask, sq)


@pytest.mark.parametrize("name,causal,window", [
    ("left", True, -1), ("right", False, 3), ("decode", True, -1), ("chunk", True, 2), ("longer_q", False, -1),
])
@torch.no_grad()
def test_padded_launch_equals_unpadded(name, causal, window):
    """The compiled path's launch (_padded: rows kept padded, keys real-first and queries real-last
    in one flash_attn_with_kvcache) against eager's (_varlen: unpadded, one varlen launch): the same
    real outputs up to rounding, zeros at pad queries, nothing non-finite (all-pad rows included)."""
    mask, sq = PADDED[name]
    b, sk = mask.shape
    torch.manual_seed(0)
    q = torch.randn(b, 4, sq, 16, device=DEVICE).transpose(1, 2)  # [B, S, H, D] views, as the forward has them
    k, v = (torch.randn(b, 2, sk + 2, 16, device=DEVICE).transpose(1, 2) for _ in range(2))  # a longer cache
    opts = dict(softmax_scale=None, causal=causal, window_size=(window, window), softcap=1.5 if causal else 0.0)
    got, want = pf_hf._padded(q, k, v, mask, opts), pf_hf._varlen(q, k, v, mask, opts)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_mistral_sliding_window_matches_sdpa(tmp_path):
    cfg = transformers.MistralConfig(**TINY, sliding_window=6)
    ours, ref = pair(tmp_path, transformers.MistralForCausalLM, cfg)
    ids = torch.randint(0, 128, (2, 19), device=DEVICE)
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_llama_prefill_and_decode_equal_eager(tmp_path):
    ours, ref = pair(tmp_path, transformers.LlamaForCausalLM, transformers.LlamaConfig(**TINY), reference="eager")
    ids = torch.randint(0, 128, (2, 23), device=DEVICE)
    out_a, out_b = ours(ids, use_cache=True), ref(ids, use_cache=True)
    torch.testing.assert_close(out_a.logits, out_b.logits, rtol=1e-4, atol=1e-4)
    nxt = out_b.logits[:, -1:].argmax(-1)
    step_a = ours(nxt, **{CACHE_ARG: out_a.past_key_values}, use_cache=True).logits
    torch.testing.assert_close(step_a, ref(nxt, **{CACHE_ARG: out_b.past_key_values}, use_cache=True).logits,
                               rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_gemma2_softcap_and_sliding_window_equal_eager(tmp_path):
    """Gemma2: logit softcapping and alternating sliding-window layers (SDPA refuses softcap)."""
    cfg = transformers.Gemma2Config(**TINY, sliding_window=5, attn_logit_softcapping=3.0, query_pre_attn_scalar=16)
    ours, ref = pair(tmp_path, transformers.Gemma2ForCausalLM, cfg, reference="eager")
    ids = torch.randint(0, 128, (2, 17), device=DEVICE)
    torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_bidirectional_sliding_window_equal_eager(tmp_path):
    """ModernBERT's local layers see w - 1 keys on each side (transformers' flash-attention rule, the
    same keys as its bidirectional sliding mask); the right side used to be unbounded."""
    cfg = transformers.ModernBertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, local_attention=8, global_attn_every_n_layers=2,
                                        max_position_embeddings=256, pad_token_id=0)
    ours, ref = pair(tmp_path, transformers.ModernBertModel, cfg, reference="eager")
    ids = torch.randint(1, 128, (2, 21), device=DEVICE)
    torch.testing.assert_close(ours(ids).last_hidden_state, ref(ids).last_hidden_state, rtol=1e-4, atol=1e-4)


def _tiny_attention_call(**kwargs):
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 5, 16, device=DEVICE), torch.randn(1, 2, 5, 16, device=DEVICE)
    with torch.no_grad():
        return pf_hf.pagedflash_attention_forward(torch.nn.Module(), q, k, k, None, **kwargs)[0]


@pytest.mark.parametrize("name,value", [
    ("sinks", torch.zeros(4)), ("learnable_sink", torch.zeros(4)), ("alibi_slopes", torch.ones(4)),
    ("head_mask", torch.ones(4)),
    ("position_bias", torch.zeros(1, 4, 5, 5)), ("output_attentions", True), ("block_table", torch.zeros(1, 1)),
    ("k_cache", torch.zeros(1)), ("use_top_left_mask", True),
])
def test_unsupported_keywords_raise_by_name(name, value):
    with pytest.raises(NotImplementedError, match=f"^{name}: pagedflash attention got {name}="):
        _tiny_attention_call(**{name: value})


def test_unknown_keywords_and_dropout_raise_known_harmless_ones_pass():
    with pytest.raises(TypeError, match="^attn_bias: pagedflash attention got an unexpected keyword argument"):
        _tiny_attention_call(attn_bias=torch.zeros(5, 5))
    with pytest.raises(ValueError, match="^dropout: pagedflash attention is inference-only"):
        _tiny_attention_call(dropout=0.1)
    want = _tiny_attention_call()
    harmless = dict(s_aux=None, head_mask=None, output_attentions=False, use_cache=True, output_hidden_states=True,
                    cache_position=torch.arange(5), deterministic=True, attn_bias=None)
    assert torch.equal(_tiny_attention_call(**harmless), want)


def test_s_aux_reaches_the_kernel_as_sinks():
    torch.manual_seed(1)
    q, k = torch.randn(1, 4, 5, 16, device=DEVICE), torch.randn(1, 2, 5, 16, device=DEVICE)
    s_aux = torch.randn(4, device=DEVICE)
    with torch.no_grad():
        got = pf_hf.pagedflash_attention_forward(torch.nn.Module(), q, k, k, None, s_aux=s_aux)[0]
    want = attention_ref(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), causal=True, sinks=s_aux)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_gpt_oss_sinks_match_eager(tmp_path):
    """gpt-oss passes its attention sinks as ``s_aux``: logits equal transformers' eager attention
    (which puts the sinks in the softmax) in prefill, a left-padded batch and decode through the cache,
    over its alternating sliding-window and full layers; and the model keeps pagedflash rather than
    being switched to a hub kernel at load time (the second hook of the module doc)."""
    pf_hf.register()
    cfg = transformers.GptOssConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=6)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    for layer in model.model.layers:  # the init's std of 0.02 would leave the sinks near 0
        layer.self_attn.sinks.normal_(0, 1.0)
    model.save_pretrained(tmp_path)
    load = lambda impl: transformers.GptOssForCausalLM.from_pretrained(  # noqa: E731
        tmp_path, attn_implementation=impl, dtype=torch.float32).to(DEVICE).eval()
    ours, ref_model = load("pagedflash"), load("eager")
    assert ours.config._attn_implementation == "pagedflash"
    ids = torch.randint(0, 128, (2, 19), device=DEVICE)
    torch.testing.assert_close(ours(ids).logits, ref_model(ids).logits, rtol=1e-4, atol=1e-4)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    real = mask.bool()
    out_a = ours(ids, attention_mask=mask, use_cache=True)
    out_b = ref_model(ids, attention_mask=mask, use_cache=True)
    torch.testing.assert_close(out_a.logits[real], out_b.logits[real], rtol=1e-4, atol=1e-4)
    nxt = out_b.logits[:, -1:].argmax(-1)
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    step_a = ours(nxt, attention_mask=mask, **{CACHE_ARG: out_a.past_key_values}, use_cache=True).logits
    step_b = ref_model(nxt, attention_mask=mask, **{CACHE_ARG: out_b.past_key_values}, use_cache=True).logits
    torch.testing.assert_close(step_a, step_b, rtol=1e-4, atol=1e-4)


def test_flash_preload_hook_skips_only_registered_names(monkeypatch):
    """The one private hook (module doc): model init's preload returns nothing for our name and hands
    every other call, arguments unchanged, to the function it wraps (that function keeps state between
    calls in some transformers releases, so the test wraps a recording stand-in)."""
    import transformers.modeling_utils as mu

    pf_hf.register()
    assert mu.lazy_import_flash_attention._pagedflash_wrapped  # installed on the real transformers
    calls, sentinel = [], object()

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return sentinel

    monkeypatch.setattr(mu, "lazy_import_flash_attention", original)
    pf_hf.register()
    hook = mu.lazy_import_flash_attention
    assert hook._pagedflash_wrapped and hook.__wrapped__ is original
    assert hook("pagedflash") is None and calls == []
    assert hook("no_such_flash_attention_impl", 1, force_import=True) is sentinel
    assert calls == [(("no_such_flash_attention_impl", 1), {"force_import": True})]


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

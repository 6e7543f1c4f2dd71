"""torch.compile over a transformers model with ``attn_implementation="pagedflash"``: no graph break
from pagedflash (``fullgraph=True``, ``aot_eager``) for unpadded prefill and decode, a padded batch
(left or right padding, then a decode step) and a packed row; results equal eager's (tests/test_compile.py
covers the public functions themselves)."""

import inspect

import pytest
import torch
import torch._dynamo.testing
from helpers import DEVICE, randn


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")
    import pagedflash.integrations.transformers as pf_hf

    pf_hf.register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY),
                                                          attn_implementation="pagedflash")
    cache_arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    return model.to(DEVICE).eval(), cache_arg


def test_llama_compiles_without_graph_breaks(llama):
    """Prefill without padding (dense kernel) and a decode step over transformers' own cache."""
    model, cache_arg = llama
    ids = torch.randint(0, 128, (2, 13), device=DEVICE)

    def prefill(ids):
        return model(ids, use_cache=True)

    def decode(ids, past):
        return model(ids, **{cache_arg: past}, use_cache=True).logits

    with torch.inference_mode():
        report = torch._dynamo.explain(prefill)(ids)
        assert report.graph_break_count == 0, [b.reason.splitlines()[0] for b in report.break_reasons]
        eager = prefill(ids)
        nxt = eager.logits[:, -1:].argmax(-1)
        torch._dynamo.reset()
        compiled = torch.compile(prefill, backend="aot_eager", fullgraph=True)(ids)
        assert torch.equal(compiled.logits, eager.logits)
        report = torch._dynamo.explain(decode)(nxt, prefill(ids).past_key_values)
        assert report.graph_break_count == 0, [b.reason.splitlines()[0] for b in report.break_reasons]
        torch._dynamo.reset()
        step = torch.compile(decode, backend="aot_eager", fullgraph=True)(nxt, compiled.past_key_values)
        assert torch.equal(step, decode(nxt, eager.past_key_values))


def test_padded_llama_compiles_without_graph_breaks(llama):
    """A padded batch: transformers' mask function and the integration read nothing on the host while
    compiling (fullgraph: a break raises). Left padding as in generation, right padding in a prefill,
    mixed lengths with a row all real and a row mostly pad, one graph for both; then a decode step
    over the left-padded cache. Eager unpads; the graph launches the padded rows (integrations/
    transformers.py, _padded), which may round differently: real tokens' logits are compared."""
    model, cache_arg = llama
    ids = torch.randint(0, 128, (3, 11), device=DEVICE)
    left, right = torch.ones_like(ids), torch.ones_like(ids)
    left[1, :4] = right[1, 7:] = 0
    left[2, :10] = right[2, 1:] = 0

    def prefill(ids, mask):
        return model(ids, attention_mask=mask, use_cache=True)

    def decode(ids, mask, past):
        return model(ids, attention_mask=mask, **{cache_arg: past}, use_cache=True).logits

    close = dict(rtol=1e-5, atol=1e-5)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    with torch.inference_mode():
        torch._dynamo.reset()
        compiled = torch.compile(prefill, backend=counter, fullgraph=True)
        for mask in (left, right):
            got, want, real = compiled(ids, mask), prefill(ids, mask), mask.bool()
            torch.testing.assert_close(got.logits[real], want.logits[real], **close)
        assert counter.frame_count == 1, "recompiled for another mask of the same shape"
        nxt = want.logits[:, -1:].argmax(-1)
        mask = torch.cat([left, torch.ones_like(nxt)], dim=1)
        got, want = compiled(ids, left).past_key_values, prefill(ids, left).past_key_values
        step = torch.compile(decode, backend="aot_eager", fullgraph=True)(nxt, mask, got)
        torch.testing.assert_close(step, decode(nxt, mask, want), **close)


def test_packed_row_compiles_without_graph_breaks(llama):
    """One row holding two sequences, told by positions restarting at 0 (cut with static shapes while
    compiling: _position_segments), equal to eager (which reads where they start); and the attention
    function given transformers' cu_seq_lens_q/k without max lengths (bounded by the row's length
    while compiling, read in eager)."""
    import pagedflash.integrations.transformers as pf_hf

    model, _ = llama
    ids = torch.randint(0, 128, (1, 23), device=DEVICE)
    positions = torch.cat([torch.arange(9), torch.arange(14)])[None].to(DEVICE)
    q, k = randn(1, 4, 23, 16), randn(1, 2, 23, 16)  # [B, H, S, D], as transformers passes them
    cu = torch.tensor([0, 9, 23], dtype=torch.int32, device=DEVICE)

    def packed(ids, positions):
        return model(ids, position_ids=positions).logits

    def attention(q, k, cu):
        return pf_hf.pagedflash_attention_forward(model, q, k, k, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0]

    with torch.inference_mode():
        for fn, args in ((packed, (ids, positions)), (attention, (q, k, cu))):
            torch._dynamo.reset()
            got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
            torch.testing.assert_close(got, fn(*args), rtol=1e-5, atol=1e-5)

"""Per-head q/k RMSNorm inside the RoPE launch (``ops.rope.rope_`` with ``q_norm_weight`` and
``k_norm_weight``; Qwen3, Qwen3-MoE, Gemma 3) against :func:`pagedflash.reference.rope_ref`, and the
reference against the unfused references (a norm per head, then RoPE); bad positions, bad arguments;
the engine with ``common.FUSED_QK_NORM`` on and off against transformers (reference path and, for
Qwen3, the kernels under the interpreter)."""

import os

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close, ids, randn
from test_model_families import assert_matches_transformers, save_family
from test_ops_layers import in_wider_rows
from test_write_faults import assert_faults

from pagedflash import reference as ref
from pagedflash import validate
from pagedflash.engine import LLM, layers
from pagedflash.engine.models import common
from pagedflash.ops import rope

EPS = 1e-6


def norm_case(t, num_q, num_kv, other_heads, head_dim, dtype, offset=0.0, max_len=64, seed=0):
    """``x [T, (Hq + Hkv + other) D]`` in NaN-padded rows (the ``other`` heads NaN: left alone),
    positions, tables, and q/k weights ``offset + w`` (Gemma stores ``1 + w``)."""
    torch.manual_seed(seed)
    x = in_wider_rows(randn(t, (num_q + num_kv + other_heads) * head_dim, dtype=dtype) * 3)
    x[:, (num_q + num_kv) * head_dim :] = float("nan")
    positions = torch.randint(0, max_len, (t,), device=DEVICE)
    angles = torch.arange(max_len, device=DEVICE)[:, None] * torch.rand(head_dim // 2, device=DEVICE)[None, :]
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    q_w, k_w = (offset + randn(head_dim, dtype=dtype) * 0.3 for _ in range(2))
    return x, positions, cos, sin, q_w, k_w


def fused_kwargs(num_q, num_kv, head_dim, q_w, k_w):
    return dict(num_heads=num_q + num_kv, head_dim=head_dim, q_norm_weight=q_w, k_norm_weight=k_w,
                num_q_heads=num_q, eps=EPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "gemma-1+w"])
@pytest.mark.parametrize("t,num_q,num_kv,other_heads,head_dim", [
    (5, 4, 2, 2, 16),  # GQA
    (3, 17, 3, 3, 8),  # 20 normed heads: two programs, the second part-full
    (7, 6, 6, 0, 24),  # odd T, MHA, HALF = 12 in a block of 16
    (1, 1, 1, 1, 2),
    (2, 0, 3, 0, 8),  # every head a k head
    (2, 3, 0, 3, 8),  # every head a q head
], ids=str)
def test_rope_with_qk_norm_matches_the_reference(t, num_q, num_kv, other_heads, head_dim, offset, dtype):
    x, positions, cos, sin, q_w, k_w = norm_case(t, num_q, num_kv, other_heads, head_dim, dtype, offset)
    normed = (num_q + num_kv) * head_dim
    want = ref.rope_ref(x, positions, cos, sin, num_q + num_kv, head_dim, q_norm_weight=q_w, k_norm_weight=k_w,
                        num_q_heads=num_q, eps=EPS)
    rope.rope_(x, positions, cos, sin, **fused_kwargs(num_q, num_kv, head_dim, q_w, k_w))
    assert_close(x[:, :normed], want[:, :normed], dtype, "normed and rotated heads")
    assert x[:, normed:].isnan().all(), "the heads after num_heads must be left alone"
    assert_faults()


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "gemma-1+w"])
def test_reference_is_a_norm_per_head_then_rope(offset):
    """In fp32 (where the unfused path's rounding of the normed heads is exact) the fused reference
    equals ``rms_norm_ref`` on each q head with the q weight and each k head with the k weight, then
    ``rope_ref``: the engine's unfused path."""
    num_q, num_kv, d, t = 4, 2, 16, 5
    x, positions, cos, sin, q_w, k_w = norm_case(t, num_q, num_kv, 2, d, torch.float32, offset)
    unfused = x.clone()
    q, k = unfused[:, : num_q * d], unfused[:, num_q * d : (num_q + num_kv) * d]
    q.copy_(ref.rms_norm_ref(q.reshape(-1, d), q_w, EPS)[0].view(t, -1))
    k.copy_(ref.rms_norm_ref(k.reshape(-1, d), k_w, EPS)[0].view(t, -1))
    want = ref.rope_ref(unfused, positions, cos, sin, num_q + num_kv, d)
    got = ref.rope_ref(x, positions, cos, sin, num_q + num_kv, d, q_norm_weight=q_w, k_norm_weight=k_w,
                       num_q_heads=num_q, eps=EPS)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_a_bad_position_gives_nan_rows_and_a_fault():
    """A position outside the tables: the row's normed heads NaN and a ``positions`` fault (the
    last bad token), no host read; the other rows as the reference."""
    validate.invalid_metadata()  # clears what earlier tests left
    x, _, cos, sin, q_w, k_w = norm_case(4, 2, 1, 1, 8, torch.float32, max_len=16)
    positions = torch.tensor([3, -1, 15, 16], device=DEVICE)
    want = ref.rope_ref(x, positions.clamp(0, 15), cos, sin, 3, 8, q_norm_weight=q_w, k_norm_weight=k_w,
                        num_q_heads=2, eps=EPS)
    rope.rope_(x, positions, cos, sin, **fused_kwargs(2, 1, 8, q_w, k_w))
    assert x[[1, 3], :24].isnan().all()
    assert_close(x[[0, 2], :24], want[[0, 2], :24], torch.float32, "valid rows")
    assert_faults(positions=3)


def test_bad_norm_arguments_are_refused_by_name():
    x, positions, cos, sin, q_w, k_w = norm_case(3, 2, 1, 1, 8, torch.float32)
    before = x.clone()
    good = fused_kwargs(2, 1, 8, q_w, k_w)
    cases = [
        (dict(q_norm_weight=randn(10)), ValueError, r"q_norm_weight: expected shape \(8,\), got \(10,\)"),
        (dict(k_norm_weight=k_w.half()), TypeError, r"k_norm_weight: expected dtype torch.float32 \(the dtype of x\)"),
        (dict(q_norm_weight=randn(16)[::2]), ValueError, "q_norm_weight: expected a contiguous tensor"),
        (dict(k_norm_weight=None), ValueError, "k_norm_weight: expected a tensor with q_norm_weight"),
        (dict(q_norm_weight=None), ValueError, "q_norm_weight: expected a tensor with k_norm_weight"),
        (dict(num_q_heads=4), ValueError, r"num_q_heads: expected an int in \[0, num_heads = 3\]"),
        (dict(num_q_heads=-1), ValueError, "num_q_heads must be an int >= 0, got -1"),
        (dict(num_q_heads=None), ValueError, "num_q_heads must be an int >= 0, got None"),
        (dict(rotary_dim=4), ValueError, r"rotary_dim: q/k norm weights need whole heads rotated \(rotary_dim = "
                                         r"head_dim = 8\), got 4"),
        (dict(eps=None), ValueError, "eps: expected a finite number >= 0, got None"),
        (dict(eps=-1.0), ValueError, "eps: expected a finite number >= 0"),
        (dict(q_norm_weight=None, k_norm_weight=None), ValueError, "num_q_heads, eps: expected None without"),
    ]
    for change, error, message in cases:
        with pytest.raises(error, match=message):
            rope.rope_(x, positions, cos, sin, **{**good, **change})
    assert torch.equal(x.nan_to_num(), before.nan_to_num()), "a refused call changes nothing"


def count_fused(monkeypatch) -> list:
    """Record each engine RoPE call made with q/k norm weights."""
    calls, real = [], layers.rope_

    def rope_(*args, **kwargs):
        if kwargs.get("q_norm_weight") is not None:
            calls.append(kwargs["num_q_heads"])
        real(*args, **kwargs)

    monkeypatch.setattr(layers, "rope_", rope_)
    return calls


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_engine_matches_transformers(tmp_path, monkeypatch, family):
    """With the switch on, prompt logits and greedy tokens (chunked prefill, paged decode, prefix-cache
    hits) equal transformers', as the unfused path's do (test_model_families); Gemma 3's q/k weights
    are the stored ``1 + w``. Every layer takes the fused call, with this rank's q heads."""
    monkeypatch.setattr(common, "FUSED_QK_NORM", True)
    calls = count_fused(monkeypatch)
    hf = save_family(tmp_path, family)
    llm = LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=48, max_num_batched_tokens=8)
    assert_matches_transformers(llm, hf)
    assert calls and set(calls) == {hf.config.num_attention_heads}


@pytest.mark.skipif(os.environ.get("PAGEDFLASH_FUSED_QK_NORM") == "1", reason="switched on for this run")
def test_switch_is_off_by_default(tmp_path, monkeypatch):
    """Off until a GPU has run it compiled and timed it: the unfused path by default."""
    assert not common.FUSED_QK_NORM
    calls = count_fused(monkeypatch)
    save_family(tmp_path, "qwen3")
    LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=16).prompt_logits([[3, 4, 5]])
    assert not calls


def test_engine_kernel_path_matches_transformers(tmp_path, monkeypatch):
    """The GPU path under the interpreter (every op a kernel) with the fused norm: Qwen3's prompt
    logits and greedy tokens equal transformers'."""
    monkeypatch.setattr(layers, "FORCE_KERNELS", True)
    monkeypatch.setattr(common, "FUSED_QK_NORM", True)
    calls = count_fused(monkeypatch)
    hf = save_family(tmp_path, "qwen3", seed=1)
    llm = LLM(tmp_path, dtype=torch.float32, page_size=4, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16)
    assert_matches_transformers(llm, hf, lengths=(9, 4), prefix_cache=False)
    assert calls

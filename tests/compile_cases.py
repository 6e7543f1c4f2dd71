"""The calls tests/test_compile*.py compile: one :class:`Case` per public function and mode of it
(paged, appending new k/v, ``out=``, split KV, attention sinks, fp8 caches with their scales, the
batch-invariant mode) and one for the decoder's other operators; each case's inputs at two sizes
(small for the CPU, real for the GPU) and at other sizes (:func:`resized`, the dynamic-shape check);
the calls on clones and the bitwise comparison with eager.

``fresh_dynamo`` resets Dynamo around every test of a file that binds it to its own name
(``fresh_dynamo = compile_cases.fresh_dynamo``): pytest finds fixtures by the names in the test's
module.
"""

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from helpers import DEVICE, cu_seqlens, randn

from pagedflash import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    merge_attn_states,
    write_kv_cache,
)
from pagedflash.ops import activation, gemv, moe, norm, rope, sampling


@dataclasses.dataclass
class Case:
    """``fn(*args)`` returns every tensor to compare, mutated inputs included; ``op`` is the operator
    (or the set of them) its graph must call; ``args`` builds fresh inputs (the same values on every
    call)."""

    fn: Callable
    op: str | set[str]
    args: Callable[[torch.dtype, bool], tuple]


def _pool(num_blocks, page, hkv, d, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (randn(num_blocks, page, hkv, d, dtype=dtype, generator=g) for _ in range(2))


def _table(rows, cols, num_blocks, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=g)[: rows * cols].view(rows, cols).to(torch.int32).to(DEVICE)


def _dense_args(dtype, big):
    b, sq, sk, hq, hkv, d = (2, 128, 300, 32, 8, 128) if big else (2, 5, 9, 4, 2, 40)
    return randn(b, sq, hq, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype), randn(b, sk, hkv, d, dtype=dtype)


def _varlen_args(dtype, big):
    lq, lk = ([100, 1, 257], [300, 64, 257]) if big else ([3, 1, 6], [7, 4, 6])
    hq, hkv, d = (32, 8, 128) if big else (4, 2, 24)
    q = randn(sum(lq), hq, d, dtype=dtype)
    k, v = randn(sum(lk), hkv, d, dtype=dtype), randn(sum(lk), hkv, d, dtype=dtype)
    return q, k, v, cu_seqlens(lq), cu_seqlens(lk), max(lq), max(lk)


def _paged_args(dtype, big):
    lq, lk, page = ([100, 1, 257], [1100, 64, 257], 16) if big else ([3, 1, 6], [11, 4, 6], 5)
    hq, hkv, d = (32, 8, 128) if big else (4, 2, 24)
    cols = -(-max(lk) // page)
    kc, vc = _pool(3 * cols + 3, page, hkv, d, dtype, seed=1)
    return (randn(sum(lq), hq, d, dtype=dtype), kc, vc, cu_seqlens(lq), cu_seqlens(lk), max(lq), max(lk),
            _table(3, cols, 3 * cols + 3, seed=2))


def _kvcache_args(dtype, big, paged):
    b, s_new, hq, hkv, d, cap = (4, 1, 32, 8, 128, 2048) if big else (3, 2, 4, 2, 24, 12)
    page = 16 if big else 4
    if paged:
        kc, vc = _pool(b * cap // page + 5, page, hkv, d, dtype, seed=3)
        table = _table(b, cap // page, b * cap // page + 5, seed=4)
    else:
        kc, vc = _pool(b, cap, hkv, d, dtype, seed=3)
        table = None
    lens = torch.tensor([cap - s_new, 0, 5][:b] + [cap // 2] * (b - 3), dtype=torch.int32, device=DEVICE)
    return (randn(b, s_new, hq, d, dtype=dtype), kc, vc, randn(b, s_new, hkv, d, dtype=dtype),
            randn(b, s_new, hkv, d, dtype=dtype), lens, table)


def random_sinks(hq, seed):
    return randn(hq, generator=torch.Generator(device=DEVICE).manual_seed(seed)) * 2


def _fp8_kvcache_args(dtype, big):
    """A paged fp8 pool with appends, per-KV-head key descales, a per-tensor value descale, sinks."""
    q, kc, vc, k, v, lens, table = _kvcache_args(dtype, big, True)
    hq, hkv = q.shape[2], kc.shape[2]
    k_descale = torch.linspace(0.5, 2.0, hkv, device=DEVICE)
    return (q, kc.float().to(torch.float8_e4m3fn), vc.float().to(torch.float8_e4m3fn), k, v, lens, table, k_descale,
            torch.tensor(0.7, device=DEVICE), random_sinks(hq, seed=9))


def _merge_args(dtype, big):
    shape = (64, 32, 128) if big else (5, 3, 40)
    lse_a, lse_b = randn(*shape[:-1]), randn(*shape[:-1])
    lse_a[0, 0], lse_b[1, 1] = float("-inf"), float("inf")  # empty states
    return randn(*shape, dtype=dtype), lse_a, randn(*shape, dtype=dtype), lse_b


def _write_args(dtype, big):
    t, blocks, page, hkv, d = (40, 64, 16, 8, 128) if big else (6, 4, 3, 2, 24)
    kc, vc = _pool(blocks, page, hkv, d, dtype, seed=5)
    slots = torch.randperm(blocks * page, generator=torch.Generator().manual_seed(6))[:t].to(DEVICE)
    slots[1] = -1  # padding: skipped
    return randn(t, hkv, d, dtype=dtype), randn(t, hkv, d, dtype=dtype), kc, vc, slots


def _fp8_write_args(dtype, big):
    k, v, kc, vc, slots = _write_args(dtype, big)
    return (k * 40, v, kc.float().to(torch.float8_e4m3fn), vc.float().to(torch.float8_e4m3fn), slots,
            torch.linspace(0.5, 2.0, kc.shape[2], device=DEVICE), torch.tensor([0.25], device=DEVICE))


def _dense(q, k, v):
    return flash_attn_func(q, k, v, causal=True, return_lse=True)


def _dense_options(q, k, v):
    return (flash_attn_func(q, k, v, softmax_scale=0.3, window_size=(3, 1), softcap=5.0),)


def _dense_sinks(q, k, v, sinks):
    return flash_attn_func(q, k, v, causal=True, return_lse=True, sinks=sinks)


def _dense_out(q, k, v):
    out = torch.zeros_like(q)
    result = flash_attn_func(q, k, v, causal=True, out=out)
    return result, out


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k):
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)


def _varlen_out(q, k, v, cu_q, cu_k, max_q, max_k):
    out = torch.zeros_like(q)
    return (flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, out=out),)


def _paged(q, kc, vc, cu_q, cu_k, max_q, max_k, table):
    return flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max_q, max_k, causal=True, block_table=table,
                                  return_lse=True)


def _paged_invariant(q, kc, vc, cu_q, cu_k, max_q, max_k, table):
    return flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max_q, max_k, causal=True, block_table=table,
                                  return_lse=True, batch_invariant=True)


def _kvcache_invariant_split(q, kc, vc, k, v, lens, table):
    out, lse = flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, block_table=table, num_splits=3,
                                       return_lse=True, batch_invariant=True)
    return out, lse, kc, vc


def _kvcache_append(q, kc, vc, k, v, lens, table):
    out, lse = flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, block_table=table, return_lse=True)
    return out, lse, kc, vc


def _kvcache_split_out(q, kc, vc, k, v, lens, table):
    out = torch.zeros_like(q)
    flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, block_table=table, num_splits=3, out=out)
    return out, kc, vc


def _kvcache_int_len(q, kc, vc, k, v, lens, table):
    return flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=5, window_size=(4, -1)), kc, vc


def _kvcache_read_only(q, kc, vc, k, v, lens, table):
    return (flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, softcap=3.0),)


def _kvcache_fp8(q, kc, vc, k, v, lens, table, k_descale, v_descale, sinks):
    out, lse = flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, block_table=table, return_lse=True,
                                       k_descale=k_descale, v_descale=v_descale, sinks=sinks)
    return out, lse, kc, vc


def _write(k, v, kc, vc, slots):
    write_kv_cache(k, v, kc, vc, slots)
    return kc, vc


def _write_fp8(k, v, kc, vc, slots, k_scale, v_scale):
    write_kv_cache(k, v, kc, vc, slots, k_scale=k_scale, v_scale=v_scale)
    return kc, vc


def _decoder_args(dtype, big):
    """One decoder layer's inputs around attention: a residual stream row block, the fused qkv
    row, RoPE tables, gate/up, projection weights and logits."""
    t, h, heads, d, inter, vocab = (4, 512, 8, 64, 1024, 5000) if big else (3, 48, 2, 8, 40, 4100)
    tables = torch.randn(32, d // 2, device=DEVICE).repeat(1, 2)
    return (randn(t, h, dtype=dtype), randn(t, h, dtype=dtype), randn(h, dtype=dtype),
            randn(t, heads * d + 8, dtype=dtype), torch.tensor([5, 0, 31, 2][:t], device=DEVICE), tables.cos(),
            tables.sin(), heads, d, randn(t, 2 * inter, dtype=dtype), randn(inter, h, dtype=dtype),
            randn(h, inter, dtype=dtype), randn(t, vocab, dtype=dtype))


def _decoder(x, res, norm_w, qkv, pos, cos, sin, heads, d, gate_up, w_in, w_out, logits):
    """Every decoder op, batched and single-row, in one graph."""
    normed, summed = norm.rms_norm(x, norm_w, 1e-5, res)
    plain, same = norm.rms_norm(x, norm_w, 1e-5)
    rope.rope_(qkv, pos, cos, sin, num_heads=heads, head_dim=d)
    rope.rope_(qkv, pos, cos, sin, num_heads=heads, head_dim=d, q_norm_weight=norm_w[:d], k_norm_weight=norm_w[-d:],
               num_q_heads=heads // 2, eps=1e-5)  # with the q/k norm
    act = activation.silu_mul(gate_up) + activation.gelu_tanh_mul(gate_up)
    row_out, row_res = gemv.rms_norm_gemv(x[:1], w_in, norm_weight=norm_w, eps=1e-5, residual=res[:1])
    down = gemv.silu_mul_gemv(gate_up[:1], w_out, norm_w) + gemv.gelu_tanh_mul_gemv(gate_up[:1], w_out)
    return (normed, summed, plain, same, qkv, act, row_out, row_res, down, gemv.gemv(x[:1], w_in),
            sampling.argmax(logits))


def _route_args(dtype, big):
    """Router logits (E no power of two on the CPU: 60) and a router bias (GPT-OSS)."""
    t, e = (64, 128) if big else (5, 60)
    return randn(t, e, dtype=dtype), randn(e, dtype=dtype)


def _route(logits, bias):
    """The MoE routing's forms: softmax renormalized, softmax, topk_softmax with a bias."""
    return (*moe.route(logits, 8), *moe.route(logits, 4, renormalize=False),
            *moe.route(logits, 4, scoring="topk_softmax", bias=bias))


CASES = {
    "dense": Case(_dense, "flash_attn_func", _dense_args),
    "dense_options": Case(_dense_options, "flash_attn_func", _dense_args),
    "dense_out": Case(_dense_out, "flash_attn_func", _dense_args),
    "dense_sinks": Case(_dense_sinks, "flash_attn_func",
                        lambda dt, big: (*_dense_args(dt, big), random_sinks(32 if big else 4, seed=8))),
    "varlen": Case(_varlen, "flash_attn_varlen_func", _varlen_args),
    "varlen_out": Case(_varlen_out, "flash_attn_varlen_func", _varlen_args),
    "varlen_paged": Case(_paged, "flash_attn_varlen_func", _paged_args),
    "varlen_paged_invariant": Case(_paged_invariant, "flash_attn_varlen_func", _paged_args),
    "kvcache_append": Case(_kvcache_append, "flash_attn_with_kvcache", lambda dt, big: _kvcache_args(dt, big, False)),
    "kvcache_paged_append": Case(_kvcache_append, "flash_attn_with_kvcache",
                                 lambda dt, big: _kvcache_args(dt, big, True)),
    "kvcache_paged_split_out": Case(_kvcache_split_out, "flash_attn_with_kvcache",
                                    lambda dt, big: _kvcache_args(dt, big, True)),
    "kvcache_int_seqlens": Case(_kvcache_int_len, "flash_attn_with_kvcache",
                                lambda dt, big: _kvcache_args(dt, big, False)),
    "kvcache_paged_invariant_split": Case(_kvcache_invariant_split, "flash_attn_with_kvcache",
                                          lambda dt, big: _kvcache_args(dt, big, True)),
    "kvcache_read_only": Case(_kvcache_read_only, "flash_attn_with_kvcache",
                              lambda dt, big: _kvcache_args(dt, big, True)),
    "kvcache_paged_fp8_sinks": Case(_kvcache_fp8, "flash_attn_with_kvcache", _fp8_kvcache_args),
    "merge": Case(merge_attn_states, "merge_attn_states", _merge_args),
    "write_kv_cache": Case(_write, "write_kv_cache", _write_args),
    "decoder_ops": Case(_decoder, {"rms_norm", "rope_", "silu_mul", "gelu_tanh_mul", "gemv", "argmax"}, _decoder_args),
    "write_kv_cache_fp8": Case(_write_fp8, "write_kv_cache", _fp8_write_args),
    "moe_route": Case(_route, "moe_route", _route_args),
}


def fresh_args(case: Case, dtype=torch.float32, big=False) -> tuple:
    torch.manual_seed(0)
    return case.args(dtype, big)


def run_on_clones(fn, args) -> list[torch.Tensor]:
    """Call ``fn`` on clones (mutations stay local) and return copies of what it returns."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.inference_mode():
        return [t.clone() for t in fn(*args)]


def assert_identical(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: result {i} is {g.dtype} {tuple(g.shape)}"
        # bitwise: -0.0 differs from 0.0, and a NaN equals the same NaN
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), \
            f"{what}: result {i} differs from eager"


def resized(name):
    """The case's inputs with other batch, length and pool sizes (same dtype, heads and head dim)."""
    torch.manual_seed(1)
    if name == "dense_out":
        return randn(3, 7, 4, 40), randn(3, 4, 2, 40), randn(3, 4, 2, 40)
    if name == "varlen_paged":
        q, kc, vc, _, _, _, _, _ = _paged_args(torch.float32, False)
        kc, vc = _pool(kc.shape[0] + 4, kc.shape[1], kc.shape[2], kc.shape[3], torch.float32, seed=7)
        lq, lk = [2, 5], [9, 5]
        return (randn(sum(lq), 4, 24), kc, vc, cu_seqlens(lq), cu_seqlens(lk), max(lq), max(lk),
                _table(2, 3, kc.shape[0], seed=8))
    if name == "kvcache_paged_fp8_sinks":
        q, kc, vc, k, v, lens, table, k_descale, v_descale, sinks = _fp8_kvcache_args(torch.float32, False)
        return q[:2], kc, vc, k[:2], v[:2], lens[:2], table[:2], k_descale, v_descale, sinks
    if name in ("kvcache_paged_append", "kvcache_int_seqlens"):
        q, kc, vc, k, v, lens, table = _kvcache_args(torch.float32, False, name == "kvcache_paged_append")
        if table is None:
            return q[:2], kc[:2], vc[:2], k[:2], v[:2], lens[:2], None
        return q[:2], kc, vc, k[:2], v[:2], lens[:2], table[:2]
    if name == "merge":
        out_a, lse_a, out_b, lse_b = _merge_args(torch.float32, False)
        return out_a[:2], lse_a[:2], out_b[:2], lse_b[:2]
    if name == "moe_route":
        logits, bias = _route_args(torch.float32, False)
        return logits[:3], bias
    if name == "decoder_ops":
        x, res, norm_w, qkv, pos, cos, sin, heads, d, gate_up, w_in, w_out, logits = _decoder_args(torch.float32, False)
        return x[:2], res[:2], norm_w, qkv[:2], pos[:2], cos, sin, heads, d, gate_up[:2], w_in, w_out, logits[:2]
    k, v, kc, vc, slots = _write_args(torch.float32, False)
    return k[:4], v[:4], kc, vc, slots[:4]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo reset before and after the test: no graph, guard or counter carries over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()

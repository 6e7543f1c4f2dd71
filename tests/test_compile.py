"""torch.compile over every public function, through the ``torch.ops.pagedflash`` operators.

- ``torch._dynamo.explain`` finds no graph break in code calling each public function (and each
  mode of it: paged, appending new k/v, ``out=``, split KV, attention sinks, fp8 caches with their
  scales, the batch-invariant mode), and the one graph calls the operator;
- ``torch.compile(fullgraph=True)`` results, mutated caches included, are bit-identical to eager,
  with static and dynamic (SymInt) shapes: on the CPU with ``aot_eager`` (the kernels under the
  interpreter) and Inductor for two cases, on the GPU with Inductor for every case and
  ``mode="reduce-overhead"`` (CUDA graphs, tests marked ``gpu``);
- the operators pass ``torch.library.opcheck`` (declared mutations, fake kernels, AOT dispatch);
- eager calls routed through the dispatcher give the same bits as the direct eager route;
- input checks still fire under compile, naming the argument.

A transformers model over pagedflash under compile: tests/test_compile_transformers.py.
"""

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch._dynamo.testing
from helpers import DEVICE, ON_GPU, cu_seqlens, randn

from pagedflash import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    merge_attn_states,
    validate,
    write_kv_cache,
)
from pagedflash.ops import activation, custom_ops, decode, gemv, norm, prefill, rope, sampling

gpu_only = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")


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


def _sinks(hq, seed):
    return randn(hq, generator=torch.Generator(device=DEVICE).manual_seed(seed)) * 2


def _fp8_kvcache_args(dtype, big):
    """A paged fp8 pool with appends, per-KV-head key descales, a per-tensor value descale, sinks."""
    q, kc, vc, k, v, lens, table = _kvcache_args(dtype, big, True)
    hq, hkv = q.shape[2], kc.shape[2]
    k_descale = torch.linspace(0.5, 2.0, hkv, device=DEVICE)
    return (q, kc.float().to(torch.float8_e4m3fn), vc.float().to(torch.float8_e4m3fn), k, v, lens, table, k_descale,
            torch.tensor(0.7, device=DEVICE), _sinks(hq, seed=9))


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
    act = activation.silu_mul(gate_up)
    row_out, row_res = gemv.rms_norm_gemv(x[:1], w_in, norm_weight=norm_w, eps=1e-5, residual=res[:1])
    down = gemv.silu_mul_gemv(gate_up[:1], w_out, norm_w)
    return (normed, summed, plain, same, qkv, act, row_out, row_res, down, gemv.gemv(x[:1], w_in),
            sampling.argmax(logits))


CASES = {
    "dense": Case(_dense, "flash_attn_func", _dense_args),
    "dense_options": Case(_dense_options, "flash_attn_func", _dense_args),
    "dense_out": Case(_dense_out, "flash_attn_func", _dense_args),
    "dense_sinks": Case(_dense_sinks, "flash_attn_func", lambda dt, big: (*_dense_args(dt, big), _sinks(32 if big else 4,
                                                                                                      seed=8))),
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
    "decoder_ops": Case(_decoder, {"rms_norm", "rope_", "silu_mul", "gemv", "argmax"}, _decoder_args),
    "write_kv_cache_fp8": Case(_write_fp8, "write_kv_cache", _fp8_write_args),
}


def _fresh(case: Case, dtype=torch.float32, big=False) -> tuple:
    torch.manual_seed(0)
    return case.args(dtype, big)


def _run(fn, args) -> list[torch.Tensor]:
    """Call ``fn`` on clones (mutations stay local) and return copies of what it returns."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.inference_mode():
        return [t.clone() for t in fn(*args)]


def _assert_identical(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: result {i} is {g.dtype} {tuple(g.shape)}"
        # bitwise: -0.0 differs from 0.0, and a NaN equals the same NaN
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), \
            f"{what}: result {i} differs from eager"


def _ops_in(graphs) -> set[str]:
    names = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            target = getattr(node.target, "_schema", None)
            if target is not None and target.name.startswith("pagedflash::"):
                names.add(target.name.split("::")[1])
    return names


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(CASES))
def test_explain_finds_no_graph_break(name):
    case = CASES[name]
    with torch.inference_mode():
        report = torch._dynamo.explain(case.fn)(*_fresh(case))
    reasons = [b.reason.splitlines()[0] for b in report.break_reasons]
    assert report.graph_break_count == 0, reasons
    assert report.graph_count == 1
    assert _ops_in(report.graphs) == (case.op if isinstance(case.op, set) else {case.op})


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_aot_eager_is_bit_identical(name):
    case = CASES[name]
    args = _fresh(case)
    want = _run(case.fn, args)
    compiled = torch.compile(case.fn, backend="aot_eager", fullgraph=True)
    _assert_identical(_run(compiled, args), want, name)


@pytest.mark.parametrize("name", ["dense_out", "varlen_paged", "kvcache_paged_append", "kvcache_int_seqlens", "merge",
                                  "write_kv_cache", "decoder_ops"] + (["kvcache_paged_fp8_sinks"] if ON_GPU else []))
def test_dynamic_shapes_compile_once(name):
    """``dynamic=True``: bit-identical to eager, and a second set of sizes reuses the graph (every
    check ran on SymInts). Duck sizing, off here, would specialize on sizes that happen to be equal
    in the first call (B == Hkv, say): torch's choice, not a check of ours."""
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        _compile_once(name)


def _compile_once(name):
    case = CASES[name]
    for module in (prefill, decode):  # the public calls' kept check outcomes, empty as in a fresh process: a
        module._CHECKED.clear()  # graph that guarded on them would recompile once the eager calls below fill them
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(case.fn, backend=counter, fullgraph=True, dynamic=True)
    first = _fresh(case)
    _assert_identical(_run(compiled, first), _run(case.fn, first), name)
    frames = counter.frame_count
    second = _resized(name)
    _assert_identical(_run(compiled, second), _run(case.fn, second), name)
    assert counter.frame_count == frames, "recompiled for the second set of sizes"


def _resized(name):
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
    if name == "decoder_ops":
        x, res, norm_w, qkv, pos, cos, sin, heads, d, gate_up, w_in, w_out, logits = _decoder_args(torch.float32, False)
        return x[:2], res[:2], norm_w, qkv[:2], pos[:2], cos, sin, heads, d, gate_up[:2], w_in, w_out, logits[:2]
    k, v, kc, vc, slots = _write_args(torch.float32, False)
    return k[:4], v[:4], kc, vc, slots[:4]


@pytest.mark.parametrize("name", list(CASES))
def test_eager_through_the_dispatcher_is_bit_identical(name):
    case = CASES[name]
    args = _fresh(case)
    direct = _run(case.fn, args)
    previous = custom_ops.dispatch_eager(True)
    try:
        routed = _run(case.fn, args)
    finally:
        custom_ops.dispatch_eager(previous)
    _assert_identical(routed, direct, name)


def _dense_op_args():
    q, k, v = _fresh(CASES["dense"])
    return q, k, v, torch.empty_like(q), 0.3, 3, 0, 5.0, True


def _paged_op_args():
    q, kc, vc, cu_q, cu_k, max_q, max_k, table = _fresh(CASES["varlen_paged"])
    return q, kc, vc, cu_q, cu_k, max_q, max_k, table, torch.empty_like(q), None, -1, 0, 0.0, 2, True


def _kvcache_op_args():
    q, kc, vc, k, v, lens, table = _fresh(CASES["kvcache_paged_append"])
    return q, kc, vc, k, v, lens, table, table.shape[1] * kc.shape[1], torch.empty_like(q), None, -1, 0, 0.0, 0, True


def _fp8_paged_op_args():
    """The engine's launch: varlen queries over an fp8 pool, with descales and sinks."""
    q, kc, vc, cu_q, cu_k, max_q, max_k, table = _fresh(CASES["varlen_paged"])
    hkv = kc.shape[2]
    return (q, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), cu_q, cu_k, max_q, max_k, table,
            torch.empty_like(q), None, -1, 0, 0.0, 2, True, _sinks(q.shape[1], seed=10),
            torch.linspace(0.5, 2.0, hkv, device=DEVICE), torch.tensor([0.7], device=DEVICE))


def _fp8_kvcache_op_args():
    q, kc, vc, k, v, lens, table, k_descale, v_descale, sinks = _fresh(CASES["kvcache_paged_fp8_sinks"])
    return (q, kc, vc, k, v, lens, table, table.shape[1] * kc.shape[1], torch.empty_like(q), None, -1, 0, 0.0, 0,
            True, sinks, k_descale, v_descale)


# one direct call per operator, with the normalized arguments the public functions pass (the side
# inputs, sinks and fp8 scales, left to their schema defaults, then given)
OP_CALLS = {
    "flash_attn_func": _dense_op_args,
    "flash_attn_varlen_func": _paged_op_args,
    "flash_attn_varlen_func[fp8, sinks]": _fp8_paged_op_args,
    "flash_attn_with_kvcache": _kvcache_op_args,
    "flash_attn_with_kvcache[fp8, sinks]": _fp8_kvcache_op_args,
    "merge_attn_states": lambda: _fresh(CASES["merge"]),
    "write_kv_cache": lambda: _fresh(CASES["write_kv_cache"]),
    "rms_norm": lambda: (*_fresh(CASES["decoder_ops"])[:3:2], 1e-5, _fresh(CASES["decoder_ops"])[1]),
    "rope_": lambda: (*_fresh(CASES["decoder_ops"])[3:9], _fresh(CASES["decoder_ops"])[8] // 2),  # half rotated
    "silu_mul": lambda: (_fresh(CASES["decoder_ops"])[9],),
    "argmax": lambda: (_fresh(CASES["decoder_ops"])[12],),
    "gemv": lambda: _gemv_op_args(),
    "write_kv_cache[fp8]": lambda: _fresh(CASES["write_kv_cache_fp8"]),
}


def _gemv_op_args():
    x, res, norm_w, *_, w_in, _, _ = _fresh(CASES["decoder_ops"])
    bias = torch.randn(w_in.shape[0], device=DEVICE)
    return x[:1], w_in, bias, res[:1], norm_w, 1e-5, 1, torch.empty(1, w_in.shape[0], device=DEVICE)


@pytest.mark.parametrize("name", list(OP_CALLS))
def test_operators_pass_opcheck(name):
    """Declared mutations are the real ones, fake kernels match the real results' shapes, dtypes and
    strides, and AOT dispatch (functionalization) runs them, with dynamic shapes."""
    op = getattr(torch.ops.pagedflash, name.split("[")[0]).default
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    if "fp8" in name:  # the schema check compares fp8 tensors with arithmetic torch's CPU lacks for them;
        tests = tests[1:]  # the declared mutations are the ones the 16-bit calls of the operator check
    torch.library.opcheck(op, OP_CALLS[name](), test_utils=tests)


def test_operator_results_have_the_fake_shapes_without_return_lse():
    q, k, v = _fresh(CASES["dense"])
    lse = torch.ops.pagedflash.flash_attn_func(q, k, v, torch.empty_like(q), None, -1, -1, 0.0, False)
    assert lse.shape == (0,) and lse.dtype == torch.float32


def test_operators_called_directly_refuse_a_wrong_out():
    """``torch.ops.pagedflash.*`` check ``out`` on the host (too small: it would be written past its
    end; another head dim, dtype or a strided last dim: a wrong result)."""
    q, k, v = _fresh(CASES["dense"])
    b, s, h, d = q.shape
    for out in (q.new_empty(b, s, h, d - 8), q.new_empty(b, s - 1, h, d), q.new_empty(b, s, h, d, dtype=torch.float16),
                q.new_empty(b, s, h, 2 * d)[..., ::2]):
        with pytest.raises(ValueError, match=r"out: expected q's shape"):
            torch.ops.pagedflash.flash_attn_func(q, k, v, out, None, -1, -1, 0.0, False)
    args = list(OP_CALLS["flash_attn_with_kvcache"]())
    args[8] = args[0].new_empty(*args[0].shape[:-1], args[0].shape[-1] + 1)
    with pytest.raises(ValueError, match=r"out: expected q's shape"):
        torch.ops.pagedflash.flash_attn_with_kvcache(*args)


def test_checks_still_fire_while_compiling():
    q, k, v = _fresh(CASES["dense"])

    def bad_window(q, k, v):
        return flash_attn_func(q, k, v, window_size=(-3, 0))

    with pytest.raises(ValueError, match="window_size: expected entries >= -1"):
        torch.compile(bad_window, backend="aot_eager")(q, k, v)
    with pytest.raises(Exception, match="window_size: expected entries >= -1"):  # fullgraph: dynamo's error
        torch.compile(bad_window, backend="aot_eager", fullgraph=True)(q, k, v)

    def wrong_kv_batch(q, k, v):
        return flash_attn_func(q, k[:1], v[:1])

    with pytest.raises(ValueError, match=r"k: expected batch 2 \(q's\), got 1"):
        torch.compile(wrong_kv_batch, backend="aot_eager", dynamic=True)(q, k, v)


def test_value_checks_are_skipped_while_compiling():
    """Checks that read device values (``.tolist()`` of cu_seqlens, page ids) cannot run on fake
    tensors: in the debug mode, off while compiling, on in eager."""
    x = torch.zeros(3)

    def probe(x):
        return x + 1 if validate.value_checks_enabled(x) else x - 1

    with validate.value_checks(True):
        assert torch.equal(probe(x), x + 1)
        assert torch.equal(torch.compile(probe, backend="aot_eager", fullgraph=True)(x), x - 1)


# -------------------------------------------------------------------------------------- Inductor
INDUCTOR_ON_CPU = ("kvcache_paged_append", "merge")  # Inductor's C++ builds are slow on a CPU: two cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32], ids=str)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", list(CASES))
def test_inductor_is_bit_identical(name, dynamic, dtype):
    """The default backend: the operators stay opaque calls between Inductor's kernels, the mutated
    ones functionalized and re-inplaced. The GPU runs every case at real sizes."""
    if not ON_GPU and (dynamic or name not in INDUCTOR_ON_CPU):
        pytest.skip("the CPU runs two static cases; the GPU runs the matrix")
    case = CASES[name]
    args = _fresh(case, dtype, big=ON_GPU)
    want = _run(case.fn, args)
    compiled = torch.compile(case.fn, fullgraph=True, dynamic=dynamic)
    for _ in range(2):
        _assert_identical(_run(compiled, args), want, name)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("name", list(CASES))
def test_reduce_overhead_cuda_graphs_are_bit_identical(name):
    """``mode="reduce-overhead"``: the calls replay a CUDA graph (no cudagraph skip) with the caches
    and outputs at fixed addresses, as an engine keeps them; every replay equals eager."""
    from torch._dynamo.utils import counters

    case = CASES[name]
    args = _fresh(case, torch.bfloat16, big=True)
    want = _run(case.fn, args)
    # the same tensors on every call: mutated inputs must keep their addresses for graph replay
    static = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    for a in static:
        if isinstance(a, torch.Tensor):
            torch._dynamo.mark_static_address(a)
    compiled = torch.compile(case.fn, mode="reduce-overhead", fullgraph=True)
    counters.clear()
    for _ in range(4):  # warm-up, record, replays
        for a, src in zip(static, args):
            if isinstance(a, torch.Tensor):
                a.copy_(src)
        with torch.inference_mode():
            got = [t.clone() for t in compiled(*static)]
        _assert_identical(got, want, name)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])

"""The ``torch.ops.pagedflash`` operators called directly, with the normalized arguments the public
functions pass (fp8 scales and sinks too): they pass ``torch.library.opcheck`` (declared mutations,
fake kernels, AOT dispatch with dynamic shapes), their results have the fake kernels' shapes, and
they check ``out`` on the host. The cases whose inputs they take: tests/compile_cases.py.
"""

import compile_cases
import pytest
import torch
from compile_cases import CASES, fresh_args, random_sinks
from helpers import DEVICE

fresh_dynamo = compile_cases.fresh_dynamo  # the shared autouse fixture, found by its name here


def _dense_op_args():
    q, k, v = fresh_args(CASES["dense"])
    return q, k, v, torch.empty_like(q), 0.3, 3, 0, 5.0, True


def _paged_op_args():
    q, kc, vc, cu_q, cu_k, max_q, max_k, table = fresh_args(CASES["varlen_paged"])
    return q, kc, vc, cu_q, cu_k, max_q, max_k, table, torch.empty_like(q), None, -1, 0, 0.0, 2, True


def _kvcache_op_args():
    q, kc, vc, k, v, lens, table = fresh_args(CASES["kvcache_paged_append"])
    return q, kc, vc, k, v, lens, table, table.shape[1] * kc.shape[1], torch.empty_like(q), None, -1, 0, 0.0, 0, True


def _fp8_paged_op_args():
    """The engine's launch: varlen queries over an fp8 pool, with descales and sinks."""
    q, kc, vc, cu_q, cu_k, max_q, max_k, table = fresh_args(CASES["varlen_paged"])
    hkv = kc.shape[2]
    return (q, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), cu_q, cu_k, max_q, max_k, table,
            torch.empty_like(q), None, -1, 0, 0.0, 2, True, random_sinks(q.shape[1], seed=10),
            torch.linspace(0.5, 2.0, hkv, device=DEVICE), torch.tensor([0.7], device=DEVICE))


def _fp8_kvcache_op_args():
    q, kc, vc, k, v, lens, table, k_descale, v_descale, sinks = fresh_args(CASES["kvcache_paged_fp8_sinks"])
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
    "merge_attn_states": lambda: fresh_args(CASES["merge"]),
    "write_kv_cache": lambda: fresh_args(CASES["write_kv_cache"]),
    "rms_norm": lambda: (*fresh_args(CASES["decoder_ops"])[:3:2], 1e-5, fresh_args(CASES["decoder_ops"])[1]),
    "rope_": lambda: (*fresh_args(CASES["decoder_ops"])[3:9], fresh_args(CASES["decoder_ops"])[8] // 2),  # half rotated
    "silu_mul": lambda: (fresh_args(CASES["decoder_ops"])[9],),
    "gelu_tanh_mul": lambda: (fresh_args(CASES["decoder_ops"])[9],),
    "argmax": lambda: (fresh_args(CASES["decoder_ops"])[12],),
    "gemv": lambda: _gemv_op_args(),
    "write_kv_cache[fp8]": lambda: fresh_args(CASES["write_kv_cache_fp8"]),
    "moe_route": lambda: (*fresh_args(CASES["moe_route"]), 4, 1, True),
}


def _gemv_op_args():
    x, res, norm_w, *_, w_in, _, _ = fresh_args(CASES["decoder_ops"])
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
    q, k, v = fresh_args(CASES["dense"])
    lse = torch.ops.pagedflash.flash_attn_func(q, k, v, torch.empty_like(q), None, -1, -1, 0.0, False)
    assert lse.shape == (0,) and lse.dtype == torch.float32


def test_operators_called_directly_refuse_a_wrong_out():
    """``torch.ops.pagedflash.*`` check ``out`` on the host (too small: it would be written past its
    end; another head dim, dtype or a strided last dim: a wrong result)."""
    q, k, v = fresh_args(CASES["dense"])
    b, s, h, d = q.shape
    for out in (q.new_empty(b, s, h, d - 8), q.new_empty(b, s - 1, h, d), q.new_empty(b, s, h, d, dtype=torch.float16),
                q.new_empty(b, s, h, 2 * d)[..., ::2]):
        with pytest.raises(ValueError, match=r"out: expected q's shape"):
            torch.ops.pagedflash.flash_attn_func(q, k, v, out, None, -1, -1, 0.0, False)
    args = list(OP_CALLS["flash_attn_with_kvcache"]())
    args[8] = args[0].new_empty(*args[0].shape[:-1], args[0].shape[-1] + 1)
    with pytest.raises(ValueError, match=r"out: expected q's shape"):
        torch.ops.pagedflash.flash_attn_with_kvcache(*args)

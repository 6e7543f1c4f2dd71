"""Gated activations of a gate/up projection's output, ``act(gate) * up`` for ``[T, 2n]`` rows (gate
first): SiLU (SwiGLU: Llama, Mistral, Qwen, ...) and tanh-approximated GELU (GeGLU: Gemma's
``gelu_pytorch_tanh``). The activation is rounded to the input dtype before the multiply, as in
transformers' unfused MLPs (:func:`pagedflash.reference.silu_mul_ref`,
:func:`pagedflash.reference.gelu_tanh_mul_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import custom_ops
from pagedflash.ops._jit import gated_product
from pagedflash.ops.utils import Launch, PlanCache, cdiv, check_gate_up_width, check_operand, next_pow2

MAX_BLOCK = 1024  # columns per program
ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _act_mul_kernel(
    GateUp,  # [T, 2 * n]: gate then up, row stride stride_g
    Out,  # [T, n]
    stride_g, stride_o, n,
    ACT: tl.constexpr,  # one of ACTIVATIONS
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(GateUp + row * stride_g + n + cols, mask=mask, other=0.0)
    tl.store(Out + row * stride_o + cols, gated_product(g, u, ACT), mask=mask)


def _check(gate_up) -> None:
    check_operand("gate_up", gate_up, (None, None))
    check_gate_up_width("gate_up", gate_up)
    validate.check_no_grad(gate_up=gate_up)


def _plan(gate_up, act: str) -> Launch:
    """Check the operand (all the checks read is in the plan's key) and work out the launch."""
    _check(gate_up)
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    block = min(MAX_BLOCK, next_pow2(n))
    return Launch(_act_mul_kernel, (t, cdiv(n, block)) if t else None, dict(ACT=act, BLOCK=block))


_PLANS = PlanCache()


def _launch(gate_up, act: str):
    key = _PLANS.key(gate_up, extra=(act,))
    plan = _PLANS.get(key) or _PLANS.add(key, _plan(gate_up, act))
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    plan(gate_up, out, gate_up.stride(0), out.stride(0), n)
    return out


_silu_op = custom_ops.implement("silu_mul", lambda gate_up: _launch(gate_up, "silu"))
_gelu_tanh_op = custom_ops.implement("gelu_tanh_mul", lambda gate_up: _launch(gate_up, "gelu_tanh"))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2n]`` (fp16/bf16/fp32, gate first, rows may be strided)
    -> ``[T, n]`` in its dtype. Checked on a call signature's first call (and when traced)."""
    if custom_ops.via_operator():
        _check(gate_up)
    return _silu_op(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` for ``gate_up [T, 2n]`` (fp16/bf16/fp32, gate first, rows
    may be strided) -> ``[T, n]`` in its dtype. Checked as :func:`silu_mul`."""
    if custom_ops.via_operator():
        _check(gate_up)
    return _gelu_tanh_op(gate_up)


def act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """:func:`silu_mul` or :func:`gelu_tanh_mul` by name (``act``, one of :data:`ACTIVATIONS`)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act: expected one of {ACTIVATIONS}, got {act!r}")
    return silu_mul(gate_up) if act == "silu" else gelu_tanh_mul(gate_up)

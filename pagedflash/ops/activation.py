"""SiLU-and-multiply of a gate/up projection's output: ``silu(gate) * up`` for ``[T, 2n]`` rows (gate
first). SiLU is rounded to the input dtype before the multiply, as in transformers' unfused MLP
(:func:`pagedflash.reference.silu_mul_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops import custom_ops
from pagedflash.ops.utils import Launch, PlanCache, cdiv, check_gate_up_width, check_operand, next_pow2

MAX_BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(
    GateUp,  # [T, 2 * n]: gate then up, row stride stride_g
    Out,  # [T, n]
    stride_g, stride_o, n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GateUp + row * stride_g + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * u).to(Out.dtype.element_ty), mask=mask)


def _check(gate_up) -> None:
    check_operand("gate_up", gate_up, (None, None))
    check_gate_up_width("gate_up", gate_up)
    validate.check_no_grad(gate_up=gate_up)


def _plan(gate_up) -> Launch:
    """Check the operand (all the checks read is in the plan's key) and work out the launch."""
    _check(gate_up)
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    block = min(MAX_BLOCK, next_pow2(n))
    return Launch(_silu_mul_kernel, (t, cdiv(n, block)) if t else None, dict(BLOCK=block))


_PLANS = PlanCache()


def _launch(gate_up):
    key = _PLANS.key(gate_up)
    plan = _PLANS.get(key) or _PLANS.add(key, _plan(gate_up))
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    plan(gate_up, out, gate_up.stride(0), out.stride(0), n)
    return out


_op = custom_ops.implement("silu_mul", _launch)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2n]`` (fp16/bf16/fp32, gate first, rows may be strided)
    -> ``[T, n]`` in its dtype. Checked on a call signature's first call (and when traced)."""
    if custom_ops.via_operator():
        _check(gate_up)
    return _op(gate_up)

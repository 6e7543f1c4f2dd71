"""SiLU-and-multiply of a gate/up projection's output: ``silu(gate) * up`` for ``[T, 2n]`` rows (gate
first). SiLU is rounded to the input dtype before the multiply, as in transformers' unfused MLP
(:func:`pagedflash.reference.silu_mul_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedflash import validate
from pagedflash.ops.utils import cdiv, check_operand, next_pow2

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


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2n]`` (fp16/bf16/fp32, gate first, rows may be strided)
    -> ``[T, n]`` in its dtype."""
    check_operand("gate_up", gate_up, (None, None))
    t, width = gate_up.shape
    if width < 2 or width % 2:
        raise ValueError(f"gate_up: expected an even, nonzero number of columns (gate then up), "
                         f"got shape {tuple(gate_up.shape)}")
    validate.check_no_grad(gate_up=gate_up)
    n = width // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(MAX_BLOCK, next_pow2(n))
        _silu_mul_kernel[(t, cdiv(n, block))](
            GateUp=gate_up, Out=out, stride_g=gate_up.stride(0), stride_o=out.stride(0), n=n, BLOCK=block,
        )
    return out

"""The decoder's steps around attention, each run by a kernel of :mod:`pagedflash.ops` on a GPU and
by the same math in PyTorch elsewhere (the ops' references, :mod:`pagedflash.reference`, cast to the
model's dtype): residual add + RMSNorm, RoPE in place, SiLU- and GELU-and-multiply, greedy argmax,
and the single-row projections of batch-1 decode with the norm or SiLU fused in front, and a mixture
of experts' routing and expert MLPs (:mod:`pagedflash.ops.moe`).

Why kernels: in plain PyTorch these are ~40 small launches per layer, and a batch-1 decode step of a
16-layer model would spend more time launching them than reading the weights. Why PyTorch off the
GPU: the interpreter runs a kernel one program at a time, far too slowly for a model.

Batch-invariant projections (a ``nn.Linear`` marked ``batch_invariant``: ``LLM(batch_invariant=True)``)
give each row the same bits whatever the other rows: on a GPU through
:func:`pagedflash.ops.matmul.matmul` (fixed tiles, no split-K), elsewhere one row at a time (the
same product for every row), and never through the single-row kernels, which reduce in another order.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedflash import reference
from pagedflash.ops import activation, gemv, matmul, moe, norm, rope, sampling

FORCE_KERNELS: bool | None = None  # None: kernels on a GPU, PyTorch elsewhere; tests force either


def use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda if FORCE_KERNELS is None else FORCE_KERNELS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``(norm(x + residual), x + residual)``, or ``(norm(x), x)``; x, residual ``[T, H]``."""
    if use_kernels(x):
        return norm.rms_norm(x, weight, eps, residual)
    out, summed = reference.rms_norm_ref(x, weight, eps, residual)
    return out.to(x.dtype), x if residual is None else summed.to(x.dtype)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
          head_dim: int, rotary_dim: int | None = None, *, q_norm_weight: torch.Tensor | None = None,
          k_norm_weight: torch.Tensor | None = None, num_q_heads: int | None = None,
          eps: float | None = None) -> None:
    """Rotate, in place, the first ``num_heads`` heads of every row of ``x [T, >= num_heads * D]``
    (rotate-half layout) by the angles of ``positions [T]``: each head's first ``rotary_dim`` dims
    (default ``D``; the rest left alone); ``cos``/``sin`` ``[max_len, >= rotary_dim]`` fp32. With
    ``q_norm_weight``/``k_norm_weight`` ``[D]``, each head RMS-normed first (the first ``num_q_heads``
    with the q weight, the rest with the k weight; :func:`pagedflash.ops.rope.rope_`)."""
    norm = {} if q_norm_weight is None and k_norm_weight is None else dict(
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, num_q_heads=num_q_heads, eps=eps)
    if use_kernels(x):
        rope.rope_(x, positions, cos, sin, num_heads=num_heads, head_dim=head_dim, rotary_dim=rotary_dim, **norm)
    else:
        x.copy_(reference.rope_ref(x, positions, cos, sin, num_heads, head_dim, rotary_dim, **norm))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2n]`` (gate first) -> ``[T, n]``."""
    if use_kernels(gate_up):
        return activation.silu_mul(gate_up)
    return reference.silu_mul_ref(gate_up).to(gate_up.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up [T, 2n]`` (gate first) -> ``[T, n]`` (Gemma's GeGLU)."""
    if use_kernels(gate_up):
        return activation.gelu_tanh_mul(gate_up)
    return reference.gelu_tanh_mul_ref(gate_up).to(gate_up.dtype)


def moe_route(router_logits: torch.Tensor, top_k: int, *, scoring: str, renormalize: bool):
    """``(topk_weights fp32 [T, k], topk_ids int32 [T, k])`` of ``router_logits [T, E]``
    (:func:`pagedflash.ops.moe.route`)."""
    if use_kernels(router_logits):
        return moe.route(router_logits, top_k, scoring=scoring, renormalize=renormalize)
    return reference.moe_route_ref(router_logits, top_k, scoring=scoring, renormalize=renormalize)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, invariant: bool = False, **kwargs) -> torch.Tensor:
    """The experts' weighted sum ``[T, H]`` in ``hidden``'s dtype (:func:`pagedflash.ops.moe.fused_moe`;
    ``kwargs``: its activation, biases, alpha and limit). ``invariant``: each token's row the same bits
    whatever the other tokens (off the GPU: one token at a time)."""
    if use_kernels(hidden):
        return moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids, batch_invariant=invariant, **kwargs)
    if invariant and hidden.shape[0] > 1:
        return torch.cat([fused_moe(hidden[t:t + 1], w13, w2, topk_weights[t:t + 1], topk_ids[t:t + 1], **kwargs)
                          for t in range(hidden.shape[0])])
    return reference.fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, **kwargs).to(hidden.dtype)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: the first index of each row's maximum of ``logits [R, V]`` -> int64 ``[R]``."""
    return sampling.argmax(logits) if use_kernels(logits) else logits.argmax(-1)


def invariant(linear_layer: nn.Linear) -> bool:
    """Whether ``linear_layer`` is to give each row the same bits whatever the other rows."""
    return getattr(linear_layer, "batch_invariant", False)


def single_row(x: torch.Tensor, linear_layer: nn.Linear | None = None) -> bool:
    """Whether the fused single-row projections serve ``x [T, ...]`` (into ``linear_layer``): one row,
    kernels on, the layer not batch-invariant."""
    return x.shape[0] == 1 and use_kernels(x) and not (linear_layer is not None and invariant(linear_layer))


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_layer, linear_layer: nn.Linear,
                out: torch.Tensor | None = None):
    """``(linear_layer(norm_layer(x + residual)), x + residual)``; ``norm_layer`` is the model's
    RMSNorm module. ``out``: where the (contiguous) result goes; a new tensor when None."""
    if single_row(x, linear_layer):
        return gemv.rms_norm_gemv(x, linear_layer.weight, linear_layer.bias, norm_weight=norm_layer.weight,
                                  eps=norm_layer.eps, residual=residual, out=out)
    h, residual = norm_layer(x, residual)
    return linear(h, linear_layer, out=out), residual


def gated_linear(gate_up: torch.Tensor, linear_layer: nn.Linear, act: str = "silu") -> torch.Tensor:
    """``linear_layer(act(gate) * up)`` for ``gate_up [T, 2n]`` (gate first); ``act`` ``"silu"`` or
    ``"gelu_tanh"``. One row: the activation fused into the projection's single-row kernel."""
    if single_row(gate_up, linear_layer):
        fused = gemv.silu_mul_gemv if act == "silu" else gemv.gelu_tanh_mul_gemv
        return fused(gate_up, linear_layer.weight, linear_layer.bias)
    return linear(silu_mul(gate_up) if act == "silu" else gelu_tanh_mul(gate_up), linear_layer)


def mlp(x: torch.Tensor, mlp_module) -> torch.Tensor:
    """``mlp_module(gate_up_proj(x))`` for the model's gated MLP (``gate_up_proj``, ``down_proj``,
    ``act``); batch-invariant on a GPU, the activation in the gate/up projection's epilogue (the bits
    of the projection, then the activation kernel, in one launch)."""
    gate_up = mlp_module.gate_up_proj
    if invariant(gate_up) and use_kernels(x):
        return linear(matmul.matmul(x, gate_up.weight, gate_up.bias, act=mlp_module.act), mlp_module.down_proj)
    return mlp_module(linear(x, gate_up))


def norm_mlp(x: torch.Tensor, residual: torch.Tensor | None, norm_layer, mlp_module):
    """``(mlp(norm_layer(x + residual)), x + residual)``: :func:`norm_linear` into the gated MLP, or
    batch-invariant on a GPU, the norm then :func:`mlp`."""
    if invariant(mlp_module.gate_up_proj) and use_kernels(x):
        h, residual = norm_layer(x, residual)
        return mlp(h, mlp_module), residual
    gate_up, residual = norm_linear(x, residual, norm_layer, mlp_module.gate_up_proj)
    return mlp_module(gate_up), residual


def linear(x: torch.Tensor, linear_layer: nn.Linear, out: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_layer(x)``: through the single-row kernel where it applies, batch-invariant where the
    layer is marked so; written into ``out`` (contiguous) when given."""
    w, b = linear_layer.weight, linear_layer.bias
    if invariant(linear_layer) and use_kernels(x):
        return matmul.matmul(x, w, b, out=out)
    if single_row(x):
        return gemv.gemv(x, w, b, out=out)
    if invariant(linear_layer) and x.shape[0] > 1:  # one row at a time: the same product for every row
        y = torch.cat([torch.nn.functional.linear(x[i:i + 1], w, b) for i in range(x.shape[0])])
    else:
        y = linear_layer(x)
    return y if out is None else out.copy_(y)

"""Compile the engine's per-layer kernels for sm_90 on any machine: what a GPU session compiles
first, checked before it has a GPU.

The public ops are called at a model shape's real sizes in bf16 (CPU tensors, nothing computed):
RMSNorm with and without the residual, RoPE with and without the fused q/k norm, SiLU-and-mul, the
single-row projections (gemv and its RMSNorm and SiLU prologues), the GEMM with the tiles
``matmul.tile`` gives sm90 (132 SMs), and the argmax of the LM head's logits; one decode row, a
64-row decode step and a 512-token prefill chunk. Each distinct kernel specialization goes through
Triton's whole pipeline for sm_90 (:func:`pagedflash.testing.compile_for`, the wheel's ptxas).
Prints its registers, spills and shared memory; exits 1 if one fails to compile. The attention,
combine and cache-write kernels launch through their own plans and are not covered here
(``tools/gluon_compile_check.py`` covers the Hopper prefill kernel).

    python tools/compile_check.py                        # the engine's dense shapes (~1-3 min)
    python tools/compile_check.py --shapes qwen3-1.7b    # one shape

Run it as a script: it sets ``TRITON_INTERPRET=0`` before pagedflash is imported (the kernels must
be defined for the compiler, not the interpreter).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # before pagedflash: its kernels must be defined for the compiler

import torch

from pagedflash.bench.shapes import SHAPES
from pagedflash.ops import activation, gemv, matmul, norm, rope, sampling
from pagedflash.testing import compile_for, cubin_resources, recorded_launches

DENSE = ("llama-3.2-1b", "qwen3-1.7b", "gemma-2-2b")
SM90 = (9, 0)
SM90_SMS = 132
ROWS = (1, 64, 512)  # one decode row, a 64-row decode step, a prefill chunk


def _calls(cfg: dict, rows: int):
    """(label, thunk) for every op of a layer (and the LM head's argmax) at ``rows`` rows of ``cfg``'s shape."""
    h, i, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    bf16 = dict(dtype=torch.bfloat16)
    x, w_h = torch.empty(rows, h, **bf16), torch.empty(h, **bf16)
    qkv = torch.empty(rows, (hq + 2 * hkv) * d, **bf16)
    positions = torch.zeros(rows, dtype=torch.int64)
    cos = sin = torch.empty(cfg.get("max_position_embeddings", 8192), d, dtype=torch.float32)
    w_d = torch.empty(d, **bf16)
    gate_up = torch.empty(rows, 2 * i, **bf16)
    w_qkv, w_down = torch.empty((hq + 2 * hkv) * d, h, **bf16), torch.empty(h, i, **bf16)
    yield "rms_norm", lambda: norm.rms_norm(x, w_h, 1e-6)
    yield "rms_norm + residual", lambda: norm.rms_norm(x, w_h, 1e-6, residual=x)
    yield "rope", lambda: rope.rope_(qkv, positions, cos, sin, num_heads=hq + hkv, head_dim=d)
    yield "rope + q/k norm", lambda: rope.rope_(qkv, positions, cos, sin, num_heads=hq + hkv, head_dim=d,
                                                q_norm_weight=w_d, k_norm_weight=w_d, num_q_heads=hq, eps=1e-6)
    yield "silu_mul", lambda: activation.silu_mul(gate_up)
    if rows == 1:
        yield "gemv qkv", lambda: gemv.gemv(x, w_qkv)
        yield "rms_norm_gemv qkv", lambda: gemv.rms_norm_gemv(x, w_qkv, norm_weight=w_h, eps=1e-6, residual=x)
        yield "silu_mul_gemv down", lambda: gemv.silu_mul_gemv(gate_up, w_down)
    yield "matmul qkv", lambda: matmul.matmul(x, w_qkv)
    yield "matmul down", lambda: matmul.matmul(torch.empty(rows, i, **bf16), w_down)
    if rows <= 64:
        yield "argmax", lambda: sampling.argmax(torch.empty(rows, vocab, **bf16))


def _as_sm90():
    """The GEMM's host rule as on an sm90 GPU of 132 SMs, with CPU tensors (restored by the caller)."""
    saved = (matmul.nvidia_capability, matmul.num_sms, matmul.interpreted)
    matmul.nvidia_capability = lambda device: SM90
    matmul.num_sms = lambda device: SM90_SMS
    matmul.interpreted = lambda: True  # lets the plan take CPU tensors; the tile reads only the two above
    return saved


def check(shapes: list[str]) -> int:
    """Compile every distinct kernel of ``shapes`` for sm_90 and print one line each; the failures' count."""
    saved = _as_sm90()
    seen, failed = set(), 0
    try:
        for name in shapes:
            for rows in ROWS:
                for label, call in _calls(SHAPES[name], rows):
                    with recorded_launches() as launches:
                        call()
                    for launch, args in launches:
                        key = (launch.kernel.__name__, tuple(sorted(launch.consts.items())),
                               tuple(sorted(launch.options.items())),
                               tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in args))
                        if key in seen:
                            continue
                        seen.add(key)
                        t0 = time.monotonic()
                        try:
                            ck = compile_for(launch, args)
                        except Exception as e:  # noqa: BLE001 - every kernel is reported
                            failed += 1
                            print(f"{name} rows={rows} {label}: {launch.kernel.__name__} FAILED "
                                  f"{type(e).__name__}: {str(e)[:400]}", flush=True)
                            continue
                        meta, usage = ck.metadata, cubin_resources(ck.asm["cubin"])
                        print(f"{name:13s} rows={rows:<4d} {label:20s} {launch.kernel.__name__:24s} "
                              f"{usage['REG']:3d} regs, {usage['LOCAL']:3d} B local (spills), smem {meta.shared:6d} B, "
                              f"{meta.num_warps} warps, {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        matmul.nvidia_capability, matmul.num_sms, matmul.interpreted = saved
    print(f"{len(seen)} kernels, {failed} failed")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(DENSE),
                        help=f"comma-separated names of bench.shapes.SHAPES (default: {','.join(DENSE)})")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected names of {sorted(SHAPES)}")
    return 1 if check(shapes) else 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())

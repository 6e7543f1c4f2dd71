"""Compile pagedflash's kernels for sm_90 on any machine, as an sm90 GPU would plan them: what a GPU
session compiles first, checked before it has a GPU (and in CI: tests/test_compile_check.py).

The public ops are called at a model shape's real sizes in bf16 (CPU tensors, nothing computed) with
every launch recorded instead of run (:func:`pagedflash.testing.recorded_launches`) and the host's
device queries answering as an sm90 GPU of 132 SMs would (capability, SM count, tensor-descriptor
loads, the fp8 conversion instruction):

- ``layers``: RMSNorm with and without the residual, RoPE with and without the fused q/k norm,
  SiLU-and-mul and GeGLU, the single-row projections (gemv and its RMSNorm, SiLU and GeGLU
  prologues), the GEMM, the argmax of the LM head's logits, and a mixture-of-experts shape's
  routing; one decode row, a 64-row decode step and a 512-token prefill chunk;
- ``attention``: the engine's attention as its layers call it (K/V written into 16-row pages, then
  one paged varlen launch with the shape's window, softcap and sinks): a 1-row and a 64-row decode
  step at 1K and 16K keys (split-KV and its combine), the decode graphs' launches (every batch size
  of the ladder, their fixed split count, the capacity as the key bound), and a 512-token chunk over
  4K cached keys; the same over an fp8 cache; contiguous decode (``flash_attn_with_kvcache``), dense
  prefill (``flash_attn_func``), ``merge_attn_states``; batch-invariant decode and prefill (with the
  opt-in prefill tile and the combine's grouped loads too). The GEMM's other forms too: K chunks (its
  split form and fold, opt-in) and, beside the decode tiles small calls run by default, the wide tile
  they run with those off, and the warp tiles (at one row sm90's default on the narrow layers, two
  others through ``PAGEDFLASH_MATMUL_WARP_TILE``).

Not covered: the Hopper Gluon prefill kernel and its metadata pre-pass (their own check,
``tools/gluon_compile_check.py``, needs Triton 3.6's Gluon). Where that kernel takes a call on an
sm90 GPU with Triton 3.6 (dense prefill and chunks of 256 rows and more), the plans compiled here
under those labels are the portable kernel's, what every other GPU and Triton runs.

Each distinct kernel specialization goes through Triton's whole pipeline for sm_90
(:func:`pagedflash.testing.compile_new`, the wheel's ptxas). Prints its registers, spills and
shared memory; exits 1 if one fails to compile.

    python tools/compile_check.py                          # the engine's dense shapes, both parts
    python tools/compile_check.py --shapes qwen3-1.7b --parts attention

Run it as a script: it sets ``TRITON_INTERPRET=0`` before pagedflash is imported (the kernels must
be defined for the compiler, not the interpreter).
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # before pagedflash: its kernels must be defined for the compiler

import torch

import pagedflash
from pagedflash.bench.shapes import SHAPES
from pagedflash.engine.runner import graph_num_splits, graph_sizes
from pagedflash.ops import activation, attention_plan, combine, gemv, matmul, moe, norm, rope, sampling
from pagedflash.ops import launch as launch_table
from pagedflash.testing import compile_new, cubin_resources, recorded_launches

DENSE = ("llama-3.2-1b", "qwen3-1.7b", "gemma-2-2b")
SM90 = (9, 0)
SM90_SMS = 132
ROWS = (1, 64, 512)  # one decode row, a 64-row decode step, a prefill chunk
PARTS = ("layers", "attention")
PAGE = 16
GRAPH_ROWS, GRAPH_LEN = 256, 8192  # decode graphs: the engine's default max_num_seqs, a model length


def _dims(cfg: dict) -> tuple[int, int, int]:
    hq = cfg["num_attention_heads"]
    return hq, cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // hq


def _layer_calls(cfg: dict, rows: int):
    """(label, thunk) for every op of a layer (and the LM head's argmax) at ``rows`` rows of ``cfg``'s shape."""
    h, i, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, d = _dims(cfg)
    bf16 = dict(dtype=torch.bfloat16)
    x, w_h = torch.empty(rows, h, **bf16), torch.empty(h, **bf16)
    qkv = torch.empty(rows, (hq + 2 * hkv) * d, **bf16)
    positions = torch.zeros(rows, dtype=torch.int64)
    cos = sin = torch.empty(cfg.get("max_position_embeddings", 8192), d, dtype=torch.float32)
    w_d = torch.empty(d, **bf16)
    gate_up = torch.empty(rows, 2 * i, **bf16)
    w_qkv, w_down = torch.empty((hq + 2 * hkv) * d, h, **bf16), torch.empty(h, i, **bf16)
    w_gate_up = torch.empty(2 * i, h, **bf16)
    yield "rms_norm", lambda: norm.rms_norm(x, w_h, 1e-6)
    yield "rms_norm + residual", lambda: norm.rms_norm(x, w_h, 1e-6, residual=x)
    yield "rope", lambda: rope.rope_(qkv, positions, cos, sin, num_heads=hq + hkv, head_dim=d)
    yield "rope + q/k norm", lambda: rope.rope_(qkv, positions, cos, sin, num_heads=hq + hkv, head_dim=d,
                                                q_norm_weight=w_d, k_norm_weight=w_d, num_q_heads=hq, eps=1e-6)
    yield "silu_mul", lambda: activation.silu_mul(gate_up)
    yield "gelu_tanh_mul", lambda: activation.gelu_tanh_mul(gate_up)
    if rows == 1:
        yield "gemv qkv", lambda: gemv.gemv(x, w_qkv)
        yield "rms_norm_gemv qkv", lambda: gemv.rms_norm_gemv(x, w_qkv, norm_weight=w_h, eps=1e-6, residual=x)
        yield "silu_mul_gemv down", lambda: gemv.silu_mul_gemv(gate_up, w_down)
        yield "gelu_tanh_mul_gemv down", lambda: gemv.gelu_tanh_mul_gemv(gate_up, w_down)
    yield "matmul qkv", lambda: matmul.matmul(x, w_qkv)
    if rows == 1:
        def down():
            matmul.matmul(torch.empty(rows, i, **bf16), w_down)
        yield "matmul down, K chunks", _opted(matmul, "CHUNK_K", True, down)
        yield "matmul qkv, wide tile", _opted(matmul, "DECODE_TILES", False, lambda: matmul.matmul(x, w_qkv))
        yield "matmul down, K chunks, wide tile", _opted(matmul, "DECODE_TILES", False,
                                                         _opted(matmul, "CHUNK_K", True, down))
    yield "matmul down", lambda: matmul.matmul(torch.empty(rows, i, **bf16), w_down)
    for act in activation.ACTIVATIONS:  # the batch-invariant MLP's gate/up projection, the activation in its epilogue
        yield f"matmul gate_up, {act}", lambda act=act: matmul.matmul(x, w_gate_up, act=act)
    if rows == 1:  # and its row tiles
        yield "matmul gate_up, silu, 8192 rows", lambda: matmul.matmul(torch.empty(8192, h, **bf16), w_gate_up,
                                                                        act="silu")
    if rows == 1:  # warp tiles other than sm90's default (matmul.WARP_TILE), one and two warps
        for spec in ("16:32:256:1:4", "16:64:128:2:4"):
            yield f"matmul down, warp tile {spec}", _opted(matmul, "WARP_TILE", matmul.parse_warp_tile(spec), down)
    if rows == 1:  # the row tiles: a narrowed 64-row tile, and two warpgroups' 128 rows
        yield "matmul qkv, 96 rows", lambda: matmul.matmul(torch.empty(96, h, **bf16), w_qkv)
        yield "matmul qkv, 8192 rows", lambda: matmul.matmul(torch.empty(8192, h, **bf16), w_qkv)
    if rows <= 64:
        yield "argmax", lambda: sampling.argmax(torch.empty(rows, vocab, **bf16))
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:  # a mixture-of-experts shape's router (GPT-OSS: topk_softmax, with a bias)
        gpt_oss = cfg.get("model_type") == "gpt_oss"
        logits, bias = torch.empty(rows, experts, **bf16), torch.empty(experts, **bf16) if gpt_oss else None
        yield "moe route", lambda: moe.route(logits, cfg["num_experts_per_tok"], bias=bias,
                                             scoring="topk_softmax" if gpt_oss else "softmax")


def _opted(module, switch: str, value, call):
    """``call`` (a thunk) run with a switch set: the GEMM's ``CHUNK_K`` (the split form and its fold) or
    ``DECODE_TILES`` (off: the wide tile at decode sizes), the batch-invariant mode's
    ``INVARIANT_PREFILL_TILE``."""
    def run():
        with mock.patch.object(module, switch, value):
            call()
    return run


def _attention_calls(cfg: dict):
    """(label, thunk) for the engine's attention at ``cfg``'s shape: K/V written into pages, then the
    paged varlen launch with the layer's window, softcap and sinks (decode steps and a prefill chunk,
    bf16 and fp8 pools), contiguous decode, dense prefill, and the batch-invariant forms."""
    hq, hkv, d = _dims(cfg)
    bf16 = dict(dtype=torch.bfloat16)
    window = cfg.get("sliding_window") or 0
    softcap = float(cfg.get("attn_logit_softcapping") or 0.0)
    sinks = torch.empty(hq, dtype=torch.float32) if cfg.get("model_type") == "gpt_oss" else None
    kw = dict(causal=True, softcap=softcap, sinks=sinks)

    def paged(rows: int, new: int, cached: int, fp8: bool = False, invariant: bool = False, windowed: bool = False,
              graph_len: int = 0):
        """K/V written into pages, then one paged varlen launch; ``graph_len``: as a decode graph
        launches it (the split count of ``graph_num_splits`` and ``max_seqlen_k`` the capacity)."""
        total = cached + new
        pages = -(-max(total, graph_len) // PAGE)
        pool = (rows * pages + 1, PAGE, hkv, d)
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        k_cache, v_cache = torch.empty(pool, dtype=dtype), torch.empty(pool, dtype=dtype)
        scales = dict(k_descale=torch.ones(hkv), v_descale=torch.ones(hkv)) if fp8 else {}
        q = torch.empty(rows * new, hq, d, **bf16)
        k = v = torch.empty(rows * new, hkv, d, **bf16)
        cu_q = torch.arange(0, rows * new + 1, new, dtype=torch.int32)
        cu_k = torch.arange(0, rows * total + 1, total, dtype=torch.int32)
        table = torch.arange(rows * pages, dtype=torch.int32).view(rows, pages)
        slots = torch.zeros(rows * new, dtype=torch.int64)
        win = (window - 1, -1) if windowed and window else (-1, -1)
        splits = graph_num_splits(rows, hkv, SM90_SMS) if graph_len else 0

        def run():
            pagedflash.write_kv_cache(k, v, k_cache, v_cache, slots, **({"k_scale": torch.ones(()),
                                                                       "v_scale": torch.ones(())} if fp8 else {}))
            pagedflash.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, new, graph_len or total,
                                              block_table=table, window_size=win, num_splits=splits,
                                              batch_invariant=invariant, **scales, **kw)
        return run

    for fp8 in (False, True):
        tag = " fp8" if fp8 else ""
        for rows, keys in ((1, 1024), (1, 16384), (64, 1024)):
            yield f"paged decode{tag} {rows}x{keys}", paged(rows, 1, keys - 1, fp8)
        yield f"paged chunk{tag} 512/4K", paged(1, 512, 4096, fp8)
    for rows in graph_sizes(GRAPH_ROWS):  # the engine's decode graphs, captured for the capacity
        yield f"graph decode {rows}x1024", paged(rows, 1, 1023, graph_len=GRAPH_LEN)
    if window:
        yield "paged decode window", paged(1, 1, 16383, windowed=True)
    yield "invariant decode 1x16K", paged(1, 1, 16383, invariant=True)
    for rows in (32, 256):  # a graph's split launch with its slot counts; the one-warp decode tile
        yield f"invariant graph decode {rows}x1024", paged(rows, 1, 1023, invariant=True, graph_len=GRAPH_LEN)
    yield "invariant graph decode fp8 256x1024", paged(256, 1, 1023, fp8=True, invariant=True, graph_len=GRAPH_LEN)
    yield "invariant chunk 512/4K", paged(1, 512, 4096, invariant=True)
    yield "invariant decode fp8 1x16K", paged(1, 1, 16383, fp8=True, invariant=True)  # q scaled per row
    yield "invariant decode 1x16K, a middle tier", _opted(launch_table, "INVARIANT_MID_KEYS", 32768,
                                                         paged(1, 1, 16383, invariant=True))
    yield "invariant decode 1x16K, combine loads 8", _opted(launch_table, "INVARIANT_COMBINE_LOADS", 8,
                                                           paged(1, 1, 16383, invariant=True))
    yield "invariant chunk fp8 512/4K", paged(1, 512, 4096, fp8=True, invariant=True)
    yield "invariant chunk, prefill tile", _opted(launch_table, "INVARIANT_PREFILL_TILE", "128:8:3",
                                                  paged(1, 512, 4096, invariant=True))

    def contiguous(rows: int, keys: int):
        q = torch.empty(rows, 1, hq, d, **bf16)
        cache = torch.empty(rows, keys, hkv, d, **bf16)
        return lambda: pagedflash.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=keys, **kw)

    yield "decode 1x16K", contiguous(1, 16384)
    yield "decode 64x1K", contiguous(64, 1024)
    q, k = torch.empty(1, 2048, hq, d, **bf16), torch.empty(1, 2048, hkv, d, **bf16)
    yield "prefill 2K", lambda: pagedflash.flash_attn_func(q, k, k, **kw)
    o, lse = torch.empty(512, hq, d, **bf16), torch.empty(512, hq)
    yield "merge states 512", lambda: combine.merge_attn_states(o, lse, o, lse)


# the host's device queries, module by module, as an sm90 GPU answers them (CPU tensors planned as CUDA ones)
_SM90 = [
    (matmul, "nvidia_capability", lambda device: SM90), (matmul, "num_sms", lambda device: SM90_SMS),
    (matmul, "interpreted", lambda: True),  # lets the GEMM's plan take CPU tensors; its tile reads the two above
    (attention_plan, "nvidia_capability", lambda device: SM90), (attention_plan, "num_sms", lambda device: SM90_SMS),
    (attention_plan, "interpreted", lambda: False), (attention_plan, "fp8_cvt_device", lambda device: True),
    (launch_table, "num_sms", lambda device: SM90_SMS), (launch_table, "nvidia_capability", lambda device: SM90),
    (launch_table, "interpreted", lambda: False), (launch_table, "tma_device", lambda device: True),
]


def _as_sm90() -> list:
    """Patch :data:`_SM90` in; returns what to restore."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in _SM90]
    for module, name, value in _SM90:
        setattr(module, name, value)
    return saved


def _cases(shapes: list[str], parts: list[str]):
    for name in shapes:
        cfg = SHAPES[name]
        if "layers" in parts:
            for rows in ROWS:
                for label, call in _layer_calls(cfg, rows):
                    yield name, f"rows={rows:<4d} {label}", call
        if "attention" in parts:
            for label, call in _attention_calls(cfg):
                yield name, label, call


def check(shapes: list[str], parts: list[str] = PARTS) -> int:
    """Compile every distinct kernel of ``shapes`` for sm_90 and print one line each; the failures' count."""
    saved = _as_sm90()
    seen, failed = set(), 0
    try:
        for name, label, call in _cases(shapes, parts):
            try:
                with recorded_launches() as launches:
                    call()
            except Exception as e:  # noqa: BLE001 - a case whose host path fails is a failure, not the end
                failed += 1
                print(f"{name} {label}: FAILED before any compile: {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            for launch, ck, error, seconds in compile_new(launches, seen):
                if error is not None:
                    failed += 1
                    print(f"{name} {label}: {launch.kernel.__name__} FAILED {type(error).__name__}: {str(error)[:400]}",
                          flush=True)
                    continue
                meta, usage = ck.metadata, cubin_resources(ck.asm["cubin"])
                print(f"{name:13s} {label:28s} {launch.kernel.__name__:22s} {usage['REG']:3d} regs, "
                      f"{usage['LOCAL']:3d} B local (spills), smem {meta.shared:6d} B, {meta.num_warps} warps, "
                      f"{seconds:.1f} s", flush=True)
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
    print(f"{len(seen)} kernels, {failed} failed")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(DENSE),
                        help=f"comma-separated names of bench.shapes.SHAPES (default: {','.join(DENSE)})")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)} (default: both)")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; expected names of {sorted(SHAPES)}")
    parts = [s for s in args.parts.split(",") if s]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts: expected names of {PARTS}, got {args.parts!r}")
    return 1 if check(shapes, parts) else 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())

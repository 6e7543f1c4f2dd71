"""``pagedflash bench moe``: the fused MoE layer (:func:`pagedflash.ops.moe.fused_moe`) at decode
(T = 1, 4, 16, 64) and prefill (T = 8192) sizes, for a Qwen3-30B-A3B layer (H 2048, I 768, 128
experts, top 8, SiLU) and a GPT-OSS-20B layer (H 2880, I 2880, 32 experts, top 4, clamped SwiGLU
with biases), bf16, routed from random logits.

Per case, each checked against :func:`pagedflash.reference.fused_moe_ref` before timing:

- ours, and a per-expert loop of PyTorch matmuls (the baseline: the experts each token picked,
  their token lists made on the host before timing, so the loop has no host sync and replays in a
  CUDA graph like ours);
- decode sizes: the bandwidth bound, the bytes of the experts the tokens picked (gate/up and down
  weights and biases, once each) plus the tokens in and out at the GPU's datasheet HBM bandwidth
  (:func:`~pagedflash.bench.hbm.hbm_bandwidth`), and ours as a percentage of it; ours and the loop
  also timed at a clean L2 (each call after a 256 MB read) where the run's flush zeroes it: zeroing
  leaves ~50 MB of dirty lines that the timed call writes back as it reads, traffic the bound does not
  count, and a decode step's layer finds L2 close to clean (the layers before it read weights and
  write little); and ours per layer in a stack of :data:`STACK` layers (each its own copy of the
  weights) run back to back, one CUDA graph a stack (unless ``--eager``), as a decode step's graph
  runs its layers: each layer's weights long gone from L2, no graph launch a layer, the kernels' own
  gaps counted;
- every size: TFLOP/s (6 * T * k * H * I FLOPs) and a dense bf16 GEMM of the same FLOPs
  (``[T*k, H] @ [H, 3I]``) for comparison; at prefill sizes both also timed in turn :data:`ROUNDS`
  times (which one first alternating), ours÷dense their median and range, so that a clock change
  between the two cases does not make the ratio.
"""

from __future__ import annotations

import torch

from pagedflash.bench.common import (
    OOM,
    Config,
    Measured,
    device,
    failures,
    free_memory,
    measure,
    ratio,
    tflops,
    timing_flush,
)
from pagedflash.bench.hbm import hbm_bandwidth
from pagedflash.bench.report import Table, print_summary, print_table, write_results
from pagedflash.ops import moe
from pagedflash.reference import fused_moe_ref
from pagedflash.testing import check_close

# name: (H, I, E, top_k, activation)
SHAPES = {
    "qwen3_30b_a3b": (2048, 768, 128, 8, "silu"),
    "gpt_oss_20b": (2880, 2880, 32, 4, "swigluoai"),
}
FULL = {"shapes": SHAPES, "tokens": (1, 4, 16, 64, 8192), "decode_max": 64, "dtype": torch.bfloat16}
QUICK = {"shapes": {"tiny_silu": (40, 24, 8, 2, "silu"), "tiny_swiglu": (40, 24, 8, 2, "swigluoai")},
         "tokens": (1, 70), "decode_max": 4, "dtype": torch.float32}
ROUNDS = 5  # prefill sizes: ours and the dense GEMM timed in turn this many times (ours÷dense, median and range)
STACK = 8  # layers in the stacked timing: the case's weights and 7 copies (Qwen3-30B-A3B: 8.5 GB more, GPT-OSS-20B: 11.1 GB)


def layer(h: int, i: int, E: int, activation: str, dtype, dev) -> dict:
    """Random expert weights (scaled so that activations stay of order one), biases for SwiGLU."""
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    weights = dict(w13=rand(E, 2 * i, h, scale=h ** -0.5), w2=rand(E, h, i, scale=i ** -0.5))
    if activation == "swigluoai":
        weights.update(w13_bias=rand(E, 2 * i, scale=0.1), w2_bias=rand(E, h, scale=0.1))
    return weights


def loop_baseline(x, w13, w2, topk_weights, topk_ids, activation, w13_bias=None, w2_bias=None, alpha=1.702,
                  limit=7.0):
    """The per-expert loop of PyTorch matmuls, its token lists made now (host) so that the returned
    call has no host sync: ``fn() -> [T, H]`` in x's dtype, accumulated in fp32."""
    I = w2.shape[2]
    experts = []
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        experts.append((e, tok, topk_weights[tok, slot, None]))
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)

    def fn():
        out.zero_()
        for e, tok, w in experts:
            gate_up = x[tok] @ w13[e].t()
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e]
            g, u = gate_up[:, :I], gate_up[:, I:]
            if activation == "silu":
                h = torch.nn.functional.silu(g) * u
            else:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                h = (u + 1) * g * torch.sigmoid(alpha * g)
            y = h @ w2[e].t()
            if w2_bias is not None:
                y = y + w2_bias[e]
            out.index_add_(0, tok, y.float() * w)
        return out.to(x.dtype)

    return fn


def active_bytes(weights: dict, topk_ids: torch.Tensor, x: torch.Tensor) -> int:
    """Bytes a decode step must move at least: each picked expert's weights once, tokens in and out."""
    experts = torch.unique(topk_ids).numel()
    per_expert = sum(t[0].numel() * t.element_size() for t in weights.values())
    return experts * per_expert + 2 * x.numel() * x.element_size()


def bound_ms(weights: dict, topk_ids: torch.Tensor, x: torch.Tensor) -> float:
    """The bandwidth bound of a decode step: :func:`active_bytes` at the GPU's HBM bandwidth
    (:func:`~pagedflash.bench.hbm.hbm_bandwidth`)."""
    return active_bytes(weights, topk_ids, x) / (hbm_bandwidth().tbps * 1e12) * 1e3


def inputs(name: str, T: int, spec: dict) -> dict:
    """One case's layer (:func:`layer`), tokens, routing from random logits and fp32 reference:
    ``fused_moe``'s arguments (``hidden`` and keywords) plus ``want`` and the shape's ``k``, ``E``."""
    h, i, E, k, activation = spec["shapes"][name]
    dtype, dev = spec["dtype"], device()
    weights = layer(h, i, E, activation, dtype, dev)
    g = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, h, generator=g, device=dev).to(dtype)
    logits = torch.randn(T, E, generator=g, device=dev)
    topk_weights, topk_ids = moe.route(logits, k, scoring="topk_softmax" if activation == "swigluoai" else "softmax")
    want = fused_moe_ref(x, topk_weights=topk_weights, topk_ids=topk_ids, activation=activation, **weights)
    return dict(hidden=x, topk_weights=topk_weights, topk_ids=topk_ids, activation=activation, weights=weights,
                want=want, k=k, E=E)


def ours_fn(case: dict):
    """``fn() -> out``: :func:`pagedflash.ops.moe.fused_moe` on an :func:`inputs` case, into one
    preallocated output (CUDA-graph capturable)."""
    x = case["hidden"]
    out = torch.empty_like(x)
    return lambda: moe.fused_moe(x, topk_weights=case["topk_weights"], topk_ids=case["topk_ids"],
                                 activation=case["activation"], out=out, **case["weights"])


def stack_fn(case: dict, layers: int = STACK):
    """``fn()``: :func:`ours_fn`'s call on ``layers`` copies of the case's weights in turn (distinct
    memory: a copy's weights are out of L2 when its turn comes again), into one output."""
    x, out = case["hidden"], torch.empty_like(case["hidden"])
    copies = [case["weights"]] + [{n: w.clone() for n, w in case["weights"].items()} for _ in range(layers - 1)]

    def fn():
        for weights in copies:
            moe.fused_moe(x, topk_weights=case["topk_weights"], topk_ids=case["topk_ids"],
                          activation=case["activation"], out=out, **weights)
        return out

    return fn


def measure_stack(case: dict, label: str) -> Measured:
    """:func:`stack_fn` timed back to back (its layers stream past L2 by themselves); ``OOM`` where the
    copies do not fit."""
    try:
        fn = stack_fn(case)
    except torch.OutOfMemoryError:
        free_memory()
        return Measured(status=OOM)
    return measure(fn, label=label, flush=None)


def dense_fn(case: dict):
    """``fn()``: a dense GEMM of the case's FLOPs, ``[T*k, H] @ [H, 3I]``."""
    x, w2 = case["hidden"], case["weights"]["w2"]
    h, i = w2.shape[1], w2.shape[2]
    a = torch.randn(x.shape[0] * case["k"], h, device=x.device).to(x.dtype)
    b = torch.randn(h, 3 * i, device=x.device).to(x.dtype)
    return lambda: a @ b


def flops(case: dict) -> int:
    """The layer's FLOPs: ``6 * T * k * H * I``."""
    w2 = case["weights"]["w2"]
    return 6 * case["hidden"].shape[0] * case["k"] * w2.shape[1] * w2.shape[2]


def in_turn(run, gemm, label: str) -> list[float]:
    """ours÷dense (throughput) over :data:`ROUNDS` rounds, each timing both, which one first alternating;
    sorted. Empty if a round failed (out of memory, say)."""
    ratios = []
    for i in range(ROUNDS):
        order = ((run, "ours"), (gemm, "dense GEMM")) if i % 2 == 0 else ((gemm, "dense GEMM"), (run, "ours"))
        timed = {who: measure(fn, label=f"{who} {label}, round {i + 1}") for fn, who in order}
        if not all(m.ok for m in timed.values()):
            return []
        ratios.append(timed["dense GEMM"].ms / timed["ours"].ms)
    return sorted(ratios)


def case(name: str, T: int, spec: dict) -> tuple[dict, list[Measured]]:
    c = inputs(name, T, spec)
    dtype, topk_ids, weights = spec["dtype"], c["topk_ids"], c["weights"]

    def check(got):
        return check_close(got, c["want"], dtype)

    label = f"{name} T={T}"
    run = ours_fn(c)
    ours = measure(run, check, label=f"ours {label}")
    loop_fn = loop_baseline(c["hidden"], topk_weights=c["topk_weights"], topk_ids=topk_ids,
                            activation=c["activation"], **weights)
    loop = measure(loop_fn, check, label=f"loop {label}")
    gemm = dense_fn(c)
    dense = measure(gemm, label=f"dense GEMM {label}")
    n = flops(c)
    row = {"shape": name, "T": T, "experts": int(torch.unique(topk_ids).numel()),
           "tiles": str(moe.tiles(T, c["k"], c["E"])),
           "ours_ms": ours.ms, "loop_ms": loop.ms, "dense_ms": dense.ms, "ours_err": ours.err, "loop_err": loop.err,
           "speedup": ratio(ours, loop), "tflops": ours.show(lambda ms: tflops(n, ms)),
           "dense_tflops": dense.show(lambda ms: tflops(n, ms)), "vs_dense": ratio(ours, dense)}
    if T > spec["decode_max"] and ours.ok and dense.ok:  # checked above: timed only
        rounds = in_turn(run, gemm, label)
        if rounds:
            row.update(vs_dense_rounds=rounds[len(rounds) // 2], vs_dense_spread=f"{rounds[0]:.3f}-{rounds[-1]:.3f}")
    if T <= spec["decode_max"]:
        bound = bound_ms(weights, topk_ids, c["hidden"])
        row.update(active_mb=active_bytes(weights, topk_ids, c["hidden"]) / 1e6, bound_ms=bound,
                   pct_bound=ours.show(lambda ms: 100 * bound / ms))
        if ours.ok:  # checked above: timed only
            stacked = measure_stack(c, f"ours {label} in a stack of {STACK}")
            row.update(stack_ms=stacked.show(lambda ms: ms / STACK),
                       stack_pct_bound=stacked.show(lambda ms: 100 * bound * STACK / ms))
            free_memory()
        if timing_flush() != "read" and ours.ok:  # checked above: timed only
            clean = measure(ours_fn(c), label=f"ours {label} clean L2", flush="read")
            clean_loop = measure(loop_fn, label=f"loop {label} clean L2", flush="read") if loop.ok else loop
            row.update(clean_ms=clean.ms, clean_pct_bound=clean.show(lambda ms: 100 * bound / ms),
                       clean_speedup=ratio(clean, clean_loop))
    return row, [ours, loop]


def main(cfg: Config) -> int:
    spec = QUICK if cfg.quick else FULL
    clean = timing_flush() != "read"  # the run's own columns are the clean-L2 ones otherwise
    clean_columns = {"clean_ms": "ours ms, clean L2", "clean_pct_bound": "% of bound, clean L2",
                     "clean_speedup": "loop÷ours, clean L2"} if clean else {}
    clean_note = ("; clean L2: the decode sizes timed again, each call after a 256 MB read (L2 left clean, as a "
                  "decode step finds it), where the run's flush zeroes L2 (dirty lines written back as the call "
                  "reads)") if clean else ""
    table = Table(
        "moe", f"Fused MoE layer, {str(spec['dtype'])[6:]}: ours against a per-expert loop of PyTorch matmuls",
        {"shape": "shape", "T": "T", "experts": "experts hit", "ours_ms": "ours ms", "loop_ms": "loop ms",
         "speedup": "loop÷ours", "pct_bound": "% of bound", **clean_columns, "stack_ms": f"ours ms, in {STACK}",
         "stack_pct_bound": f"% of bound, in {STACK}", "tflops": "TFLOP/s",
         "dense_tflops": "dense TFLOP/s", "vs_dense": "ours÷dense", "vs_dense_rounds": f"ours÷dense, {ROUNDS} rounds",
         "vs_dense_spread": "range"},
        note=f"bound = bytes of the picked experts' weights (once each) + tokens in and out at {hbm_bandwidth()} "
             f"(decode sizes){clean_note}; in {STACK}: per layer, {STACK} layers (each its own copy of the weights) "
             "back to back (one CUDA graph a stack; eager calls under --eager), as a decode step runs them. "
             "FLOPs = 6*T*k*H*I; "
             f"dense = one [T*k, H] @ [H, 3I] GEMM of the same FLOPs; prefill sizes: ours and dense also timed in "
             f"turn {ROUNDS} times (which first alternating), the median ratio and its range. "
             "Ratios: throughput, same run (>1: ours faster). Every case checked against the fp32 reference "
             "first; FAIL = wrong result, not timed.",
    )
    bad = 0
    for name in spec["shapes"]:
        for T in spec["tokens"]:
            row, ours = case(name, T, spec)
            table.rows.append(row)
            bad += failures(ours)
            free_memory()
    print_table(table)
    summary = {"failures": bad}
    for name in spec["shapes"]:
        rows = [r for r in table.rows if r["shape"] == name]
        summary[f"{name}_min_speedup_decode"] = min(
            (r["speedup"] for r in rows if r["T"] <= spec["decode_max"] and isinstance(r["speedup"], float)),
            default="n/a")
        summary[f"{name}_pct_bound_T1"] = next((r.get("pct_bound") for r in rows if r["T"] == 1), "n/a")
        summary[f"{name}_pct_bound_T1_clean_l2"] = next(
            (r.get("clean_pct_bound" if clean else "pct_bound", "n/a") for r in rows if r["T"] == 1), "n/a")
        summary[f"{name}_pct_bound_T1_in_stack"] = next((r.get("stack_pct_bound", "n/a") for r in rows if r["T"] == 1),
                                                        "n/a")
        summary[f"{name}_vs_dense_largest_T"] = rows[-1]["vs_dense"]
        summary[f"{name}_vs_dense_largest_T_rounds"] = rows[-1].get("vs_dense_rounds", "n/a")
    print_summary(summary)
    path = write_results("moe", [table], cfg.out, quick=cfg.quick, summary=summary)
    print(f"wrote {path}")
    return 1 if bad else 0

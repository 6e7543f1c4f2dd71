"""The batch-invariant GEMM (pagedflash/ops/matmul.py) against cuBLAS (F.linear) on an engine model's
projections, bf16, in the same run; and whether each keeps a row's bits when M changes (ours must;
cuBLAS picks its kernel by M).

    python tools/tune_matmul.py [--shape llama-3.2-1b] [--rows 1,8,32,64,8192] [--objective decode]
                                [--sweep] [--chunk-k] [--out PATH] [--budget-s S] [--smoke]

``--shape``: the weights that model shape's engine runs through ``matmul`` in batch-invariant mode
(:func:`projections`, from ``pagedflash/bench/shapes.py`` through ``ModelConfig``; comma-separated
for several; default ``llama-3-8b``): qkv, o_proj, gate_up, down in every layer and the LM head
once; a mixture of experts (qwen3-30b-a3b, gpt-oss-20b) has qkv, o_proj, its router and the LM head
(gate_up and down only in dense layers; qwen1.5-moe-a2.7b's shared expert, its gate_up and down, in
every MoE layer, its gate a row of the router): its routed experts run in ``fused_moe``'s own invariant tiles
(``ops/moe.py``), not through ``matmul``. ``--rows`` (default 1, 32, 256, 8192): the M values timed.

Each case cycles through enough copies of its weight (> 2x L2) inside one CUDA graph, as the layers
of a model do, so weights come from HBM. Each candidate is timed as the one tile of every M (decode
tiles off), and a weight's best tile is the one with the best geometric mean of cuBLAS / ours: over
every M (``--objective all``) or over the decode rows, M <= 64 (``--objective decode``, the prefill
rows' ratios shown beside).
``--sweep`` also times :data:`SWEEP` (16-256 columns: a narrow layer, N = 2048, has 16 column tiles of
128 for 132 SMs at M = 1); ``--prefill-sweep`` :data:`PREFILL_SWEEP` (128 rows, 8 warps:
``matmul.ROW_TILES``' form; time them at prefill rows, ``--rows 256,1024,2048,8192``); a candidate
that matmul or Triton refuses is skipped with its reason.
``--warp-sweep`` :data:`WARP_SWEEP` (16 rows, one or two warps: the warp's MMA instead of the
warpgroup's; time them at decode rows, ``--rows 1,4,16``, and read the bit-for-bit line).
``--chunk-k``: also each timed tile with K in fixed chunks (:func:`chunked`, ``matmul.CHUNK_K``'s rule).
Each weight's log also says which timed unchunked tiles give, bit for bit, the first one's whole
output: every unchunked tile sums K in the same 16-deep MMA steps in the same order, so where the
device's MMA rounds an element the same whatever the tile, a rule may pick the tile by M and stay
invariant (``matmul.DECODE_TILES``; on an H100 all 32 swept tiles did, docs/performance.md v41).

Output: everything goes to ``--out`` (default ``$OUT/tune_matmul.log``, else ``tune_matmul.log``),
each weight's full ranking as soon as it is timed; stdout gets the top 6 of each, and its last lines
are a summary: per weight the current and the best tile with their ratios per M, matmul's own choice
per M (its decode and row tiles as set: ``matmul.DECODE_TILES``, ``ROW_TILES``) and its ratio, the decode step's
GEMM time (weights x layers) and a suggested rule on N. ``--budget-s`` shares a time cap among the
weights (the current tile is always timed). ``--smoke``: the shapes at ``tiny`` sizes on the CPU
interpreter (checks the script; its times mean nothing, and its invariance flag is the interpreter's:
numpy's matmul is not row-invariant, tests/test_matmul.py).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedflash.bench.common import geomean, time_ms
from pagedflash.bench.shapes import SHAPES as MODELS
from pagedflash.bench.shapes import shape_config
from pagedflash.engine import ModelConfig
from pagedflash.ops import matmul as mm
from pagedflash.ops.utils import cdiv, next_pow2, num_sms

ROWS = (1, 32, 256, 8192)
SMOKE_ROWS = (1, 3, 70)
DECODE_ROWS = mm.BLOCK_M  # the decode objective's rows: M within one row tile
SMEM = 227 * 1024  # sm90's shared memory a block: candidates whose pipeline would not fit are not tried
# (block_n, block_k), bn * bk <= 16384; 8 warps only where the tile is wide enough to share
PAIRS = ((16, 128), (16, 256), (32, 128), (32, 256), (64, 128), (64, 256), (128, 64), (128, 128), (256, 64))
SWEEP = [mm.Tile(mm.BLOCK_M, bn, bk, w, st, 8) for (bn, bk), w, st in itertools.product(PAIRS, (4, 8), (3, 4, 5))
         if (w == 4 or bn >= 128) and st * (mm.BLOCK_M + bn) * bk * 2 <= SMEM]
SMOKE_SWEEP = [mm.Tile(mm.BLOCK_M, bn, 64, 4, 2, 8) for bn in (16, 32)]
# --prefill-sweep: 128-row tiles, two warpgroups each issuing the 64-row wgmma (matmul.tall_tile's form)
PREFILL_SWEEP = [mm.Tile(2 * mm.BLOCK_M, bn, bk, 8, st, 8) for (bn, bk), st in itertools.product(
    ((128, 64), (128, 128), (256, 64)), (3, 4, 5)) if st * (2 * mm.BLOCK_M + bn) * bk * 2 <= SMEM]
SMOKE_PREFILL_SWEEP = [mm.Tile(2 * mm.BLOCK_M, 32, 64, 8, 2, 8)]
# --warp-sweep: 16-row tiles of one or two warps, each issuing the warp's MMA (mma.sync m16n8k16) rather
# than a warpgroup's wgmma: batch-1 decode wastes 63 of the 64-row tile's rows. A row tile of another MMA
# instruction keeps a row's bits only where the device rounds both alike (the attention decode tile's
# premise, shown on an H100 by tests/test_batch_invariance.py): the log's bit-for-bit line says whether they do
WARP_SWEEP = [mm.Tile(16, bn, bk, w, st, 8) for bn, bk, w, st in itertools.product(
    (16, 32, 64), (128, 256), (1, 2), (3, 4)) if st * (16 + bn) * bk * 2 <= SMEM]
SMOKE_WARP_SWEEP = [mm.Tile(16, 16, 64, 1, 2, 8)]


def projections(name: str, *, small: bool = False) -> dict[str, tuple[int, int, int]]:
    """``label -> (N, K, per step)``: the weights ``[N, K]`` model shape ``name``'s engine runs through
    ``matmul`` in batch-invariant mode and how many of each a decode step runs (module doc); weights
    of one shape share a label (``a+b``). ``small``: at ``tiny``'s sizes (:func:`shape_config`)."""
    cfg = ModelConfig.from_dict(shape_config(name, small=small))
    h, q, kv, layers = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_layers
    dense = len(cfg.dense_layers) if cfg.num_experts else layers
    found = [("qkv", q + 2 * kv, h, layers), ("o_proj", h, q, layers)]
    shared = cfg.shared_expert_intermediate_size  # Qwen2-MoE: beside every MoE layer's experts
    if cfg.num_experts:  # with a shared expert, its one-column gate is the router's last row
        found.append(("router", cfg.num_experts + (shared > 0), h, layers - dense))
    if shared:
        found += [("shared_gate_up", 2 * shared, h, layers - dense), ("shared_down", h, shared, layers - dense)]
    if dense:
        found += [("gate_up", 2 * cfg.intermediate_size, h, dense), ("down", h, cfg.intermediate_size, dense)]
    found.append(("lm_head", cfg.vocab_size, h, 1))
    out: dict[tuple[int, int], tuple[str, int]] = {}
    for label, n, k, count in found:
        if count:
            prev = out.get((n, k))
            out[n, k] = (f"{prev[0]}+{label}", prev[1] + count) if prev else (label, count)
    return {label: (n, k, count) for (n, k), (label, count) in out.items()}


def chunked(t: mm.Tile, n: int, k: int, sms: int, min_chunk: int = mm.MIN_CHUNK) -> mm.Tile | None:
    """``t`` with K in the fixed chunks ``matmul.tile`` gives its own tile under ``CHUNK_K``
    (``matmul.k_chunk``, here for any tile); None where the rule makes none."""
    chunk = mm.k_chunk(n, k, t.block_n, t.block_k, sms, min_chunk)
    return t._replace(chunk_k=chunk) if chunk else None


def fits(t: mm.Tile, n: int, k: int) -> bool:
    """No wider than N, no deeper than K needs (``matmul.tile`` clamps its own tile likewise)."""
    return t.block_n <= max(16, next_pow2(n)) and t.block_k <= max(16, next_pow2(k))


def name(t: mm.Tile) -> str:
    rows = f"bm{t.block_m} " if t.block_m != mm.BLOCK_M else ""
    return rows + f"bn{t.block_n} bk{t.block_k} w{t.warps} s{t.stages}" + (f" chunks {t.chunk_k}" if t.chunk_k else "")


def rule_form(t: mm.Tile) -> str:
    """The tile as ``matmul.Tile``'s constructor takes it; chunks as ``CHUNK_K`` (their size follows K)."""
    return f"Tile({t.block_m}, {t.block_n}, {t.block_k}, {t.warps}, {t.stages}, {t.group_m})" + \
        (" + CHUNK_K" if t.chunk_k else "")


def rows_arg(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(sorted({int(v) for v in text.split(",")}))
    except ValueError:
        rows = ()
    if not rows or rows[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive row counts (1,8,32,64,8192), got {text!r}")
    return rows


def graph_us(fn, calls: int) -> float:
    """Mean µs per call of ``fn(i)`` for i in range(calls), captured in one CUDA graph and replayed
    back to back (the calls stream their own weight copies)."""
    return time_ms(lambda: [fn(i) for i in range(calls)], graph=True, flush=None, reps=5) * 1e3 / calls


def invariant(linear, x: torch.Tensor, w: torch.Tensor) -> bool:
    """Rows 0, 1 and the last of ``linear(x)`` bitwise equal to the same rows computed alone and in a
    batch of 32."""
    full = linear(x, w)
    rows = (0, 1, x.shape[0] - 1)
    alone = all(torch.equal(linear(x[i:i + 1], w)[0], full[i]) for i in rows)
    batch = linear(torch.cat([x[list(rows)], x[:32 - len(rows)]]), w)
    return alone and all(torch.equal(batch[j], full[i]) for j, i in enumerate(rows))


def with_tile(t: mm.Tile | None, fn, *args):
    """``fn(*args)`` with every M on tile ``t`` (decode and row tiles off: a candidate is timed as
    itself)."""
    saved, mm.TILE, mm.DECODE_TILES, mm.ROW_TILES = (mm.DECODE_TILES, mm.ROW_TILES), t, False, False
    try:
        return fn(*args)
    finally:
        mm.TILE, (mm.DECODE_TILES, mm.ROW_TILES) = None, saved


class Log:
    """Lines to the file (always, flushed) and to stdout (unless ``file_only``)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.file = path, open(path, "w")

    def __call__(self, line: str = "", file_only: bool = False) -> None:
        self.file.write(line + "\n")
        self.file.flush()
        if not file_only:
            print(line, flush=True)


def measure(n: int, k: int, rows, tiles: list[mm.Tile], smoke: bool, deadline: float, log: Log):
    """cuBLAS's µs per M and each tile's (a list as long as ``rows``, or the reason it has none;
    tiles after the first are skipped past ``deadline``)."""
    dev, dt = ("cpu", torch.float16) if smoke else ("cuda", torch.bfloat16)
    copies = 2 if smoke else max(2, cdiv(300_000_000, n * k * 2))
    weights = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
    x_all = torch.randn(max(*rows, 32), k, device=dev, dtype=dt)
    calls = max(2, copies)
    base = [graph_us(lambda i, x=x_all[:m]: F.linear(x, weights[i % copies]), calls) for m in rows]
    rule = []  # matmul's own choice per M (its switches as set): (us, the tile it ran)
    for m in rows:
        x = x_all[:m]
        out = mm.matmul(x, weights[0])
        c = mm._PLANS[mm.plan_key(x, weights[0], None, out)].main.consts
        rule.append((graph_us(lambda i, x=x: mm.matmul(x, weights[i % copies]), calls),
                     f"bm{c['BLOCK_M']} bn{c['BLOCK_N']} bk{c['BLOCK_K']}"))
    times: dict[mm.Tile, list[float] | str] = {}
    same: dict[mm.Tile, bool] = {}  # each later timed unchunked tile's whole output bitwise the first one's
    first = None
    for j, t in enumerate(tiles):
        if j and time.monotonic() > deadline:
            times[t] = "not timed: budget spent"
            continue
        us = []
        for m in rows:
            x = x_all[:m]
            try:
                with_tile(t, mm.matmul, x, weights[0])  # compiled and checked outside the graph
                us.append(with_tile(t, graph_us, lambda i, x=x: mm.matmul(x, weights[i % copies]), calls))
            except Exception as e:  # noqa: BLE001 - a tile matmul or Triton refuses is reported, not fatal
                us = f"refused at M={m}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                log(f"  {name(t)}: {us}", file_only=True)
                break
        times[t] = us
        if isinstance(us, list) and not t.chunk_k:  # chunks sum K in another order: other bits by design
            got = with_tile(t, mm.matmul, x_all, weights[0])
            if first is None:
                first = got
            else:
                same[t] = torch.equal(got, first)
    flags = {"cuBLAS": invariant(F.linear, x_all, weights[0])}
    return base, rule, times, flags, same, lambda t: with_tile(t, invariant, mm.matmul, x_all, weights[0])


def rank(rows, base, times, objective: str) -> list[tuple[float, mm.Tile, list[float]]]:
    """``(score, tile, cuBLAS / ours per M)``, best first; the score: the geometric mean over the
    objective's rows."""
    keep = [i for i, m in enumerate(rows) if objective == "all" or m <= DECODE_ROWS]
    out = []
    for t, us in times.items():
        if isinstance(us, list):
            ratios = [b / u for b, u in zip(base, us)]
            out.append((geomean([ratios[i] for i in keep]), t, ratios))
    return sorted(out, key=lambda e: -e[0])


def ratios_text(rows, ratios, objective: str) -> str:
    cells = [f"{m}:{r:.2f}" for m, r in zip(rows, ratios)]
    split = sum(m <= DECODE_ROWS for m in rows) if objective == "decode" else len(rows)
    return " ".join(cells[:split]) + (" | " + " ".join(cells[split:]) if split < len(rows) else "")


def suggest(weights: list[tuple[int, dict]]) -> str:
    """One tile per N, from ``(N, {tile: score})`` of each weight: the tile whose geometric mean over
    the weights of that N is best (among tiles timed on all of them; chunked tiles as one form), then
    neighbouring N with the same tile merged: ``N <= a: Tile(..); ...; else: Tile(..)``."""
    picks = []
    for n in sorted({n for n, _ in weights}):
        scores = [{rule_form(t): s for t, s in sc.items()} for m, sc in weights if m == n]
        common = set.intersection(*(set(s) for s in scores))
        if common:
            best = max(sorted(common), key=lambda f: geomean([s[f] for s in scores]))
            if picks and picks[-1][1] == best:
                picks[-1] = (n, best)
            else:
                picks.append((n, best))
    if len(picks) == 1:
        return f"every N: {picks[0][1]}"
    parts = [f"N <= {n}: {form}" for n, form in picks[:-1]] + ([f"else: {picks[-1][1]}"] if picks else [])
    return "; ".join(parts) or "none (no tile timed on every weight)"


def candidates(n: int, k: int, current: mm.Tile, args, sms: int, dev: torch.device) -> list[mm.Tile]:
    """The current tile, its decode and 128-row tiles (``matmul.decode_tile`` and ``tall_tile``), the sweep's
    that fit, and with ``--chunk-k`` each one's K-chunk form (on the interpreter chunks of one K
    step: its tiny K would have none)."""
    grid = list((SMOKE_SWEEP if args.smoke else SWEEP) if args.sweep else [])
    grid += (SMOKE_PREFILL_SWEEP if args.smoke else PREFILL_SWEEP) if args.prefill_sweep else []
    grid += (SMOKE_WARP_SWEEP if args.smoke else WARP_SWEEP) if args.warp_sweep else []
    dt = torch.float16 if args.smoke else torch.bfloat16
    decode, tall = mm.decode_tile(current, n, k, dt, dev), mm.tall_tile(current, n, k, dt, dev)
    tiles = list(dict.fromkeys([current, decode, tall] + [t for t in grid if fits(t, n, k)]))
    if args.chunk_k:
        chunks = (chunked(t, n, k, sms, t.block_k if args.smoke else mm.MIN_CHUNK) for t in tiles)
        tiles += [c for c in dict.fromkeys(chunks) if c is not None and c not in tiles]
    return tiles


def report(log: Log, n: int, k: int, rows, objective: str, base, times, flags, ranked) -> None:
    """One weight's lines: the current tile per M (as ``times``' first), the invariance flags, the
    ranking (the top 6 on stdout, all in the file) and the tiles refused or not timed (file)."""
    current = next(iter(times))
    us = times[current] if isinstance(times[current], list) else [None] * len(rows)
    for m, b, u in zip(rows, base, us):
        tflops, tbs = (2 * m * n * k / u / 1e6, (n * k + m * (n + k)) * 2 / u / 1e6) if u else (0, 0)
        perf = f"ours {u:9.2f} us ({tflops:6.1f} TFLOP/s, {tbs:5.2f} TB/s)  cuBLAS/ours {b / u:.2f}" if u else "refused"
        log(f"  M={m:5d}: cuBLAS {b:9.2f} us  {perf}")
    log(f"  bitwise row invariance (M=1, 32, {max(*rows, 32)}): " + ", ".join(f"{t}: {v}" for t, v in flags.items()))
    for i, (score, t, ratios) in enumerate(ranked):
        log(f"  {i + 1:2d}. {score:.3f}  {name(t):24s} {ratios_text(rows, ratios, objective)}", file_only=i >= 6)
    for t, why in times.items():
        if isinstance(why, str):
            log(f"  -- {name(t)}: {why}", file_only=True)


def tune_model(model: str, args, log: Log, start: float, share: tuple[int, int]) -> list[str]:
    """Time ``model``'s weights (``share``: how many weights came before, of how many, for the
    budget); returns its summary lines."""
    rows, objective = args.rows, args.objective
    dev = torch.device("cpu" if args.smoke else "cuda")
    summary, scored, step, cross = [], [], {m: [0.0, 0.0, 0.0] for m in rows if m <= DECODE_ROWS}, []
    for label, (n, k, count) in projections(model, small=args.smoke).items():
        t0 = time.monotonic()
        current = mm.tile(n, k, torch.float16 if args.smoke else torch.bfloat16, dev)
        tiles = candidates(n, k, current, args, num_sms(dev), dev)
        log(f"{model} {label}: N={n} K={k}, {count} a step; current {name(current)}; {len(tiles)} tiles x "
            f"{len(rows)} rows")
        deadline = start + args.budget_s * (share[0] + len(scored) + 1) / share[1]
        base, rule, times, flags, same, check = measure(n, k, rows, tiles, args.smoke, deadline, log)
        ranked = rank(rows, base, times, objective)
        for t in dict.fromkeys([current] + [e[1] for e in ranked[:1]]):
            if isinstance(times[t], list):
                flags[name(t)] = check(t)
        del check  # the weights go before the next weight's are made
        report(log, n, k, rows, objective, base, times, flags, ranked)
        rule_text = " ".join(f"{m}:{b / u:.2f} ({t})" for m, b, (u, t) in zip(rows, base, rule))
        log(f"  matmul's rule per M (decode tiles {mm.DECODE_TILES}, row tiles {mm.ROW_TILES}): {rule_text}")
        differ = [name(t) for t, v in same.items() if not v]
        log(f"  other tiles whose output is bitwise the first timed tile's (M={max(*rows, 32)}): "
            f"{len(same) - len(differ)} of {len(same)}" + (f"; differ: {', '.join(differ)}" if differ else ""))
        cross.append(not differ)
        log(f"  ({time.monotonic() - t0:.1f} s)")
        cur = next((e for e in ranked if e[1] == current), None)
        text = [f"{name(t)} {s:.3f} [{ratios_text(rows, r, objective)}] inv {flags.get(name(t))}"
                for s, t, r in filter(None, (cur, ranked[0] if ranked else None))]
        summary.append(f"{label} {n}x{k} x{count}: current {text[0] if cur else 'refused'}; "
                       f"best {text[-1] if ranked else 'none'}; rule [{rule_text}]")
        scored.append((n, {t: s for s, t, _ in ranked}))
        if cur:
            for i, m in enumerate(rows):
                for j, us in enumerate((base[i], times[current][i], times[ranked[0][1]][i]) if m in step else ()):
                    step[m][j] += count * us
    device = "CPU interpreter: times mean nothing" if args.smoke else torch.cuda.get_device_name()
    over = f"M <= {DECODE_ROWS}, prefill rows after |" if objective == "decode" else "every M"
    steps = "; ".join(f"M={m}: cuBLAS {c:.0f}, current {o:.0f} ({c / o:.2f}), best {b:.0f} ({c / b:.2f})"
                      for m, (c, o, b) in step.items() if o)
    return [f"== summary {model} ({device}), objective {objective}: geomean cuBLAS/ours over {over} ==", *summary,
            f"decode step us (weights x per step): {steps or f'no rows <= {DECODE_ROWS}'}",
            f"suggested rule ({model}): {suggest(scored)}",
            f"every timed tile gives the first timed tile's bits: {sum(cross)} of {len(cross)} weights"]


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b",
                        help=f"model shape(s), comma-separated, of {', '.join(MODELS)} (default llama-3-8b)")
    parser.add_argument("--rows", type=rows_arg, default=None, help="M values, e.g. 1,8,32,64,8192 "
                        f"(default {','.join(map(str, ROWS))}; --smoke {','.join(map(str, SMOKE_ROWS))})")
    parser.add_argument("--objective", choices=("decode", "all"), default="all",
                        help=f"rank by the geometric mean over M <= {DECODE_ROWS} (decode) or over every M (all)")
    parser.add_argument("--sweep", action="store_true", help="also time the candidate tiles")
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="also time 128-row tiles of two warpgroups (matmul.tall_tile's form)")
    parser.add_argument("--warp-sweep", action="store_true",
                        help="also time 16-row tiles of one or two warps (the warp's MMA; time them at M <= 16)")
    parser.add_argument("--chunk-k", action="store_true", help="also each timed tile with K in fixed chunks")
    parser.add_argument("--out", type=Path, default=None,
                        help="the full log (default $OUT/tune_matmul.log if OUT is set, else ./tune_matmul.log)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="time cap, shared among the weights")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the interpreter)")
    args = parser.parse_args(argv)
    models = args.shape.split(",")
    for model in models:
        if model not in MODELS:
            parser.error(f"argument --shape: expected one of {', '.join(MODELS)}, got {model!r}")
    args.rows = args.rows or (SMOKE_ROWS if args.smoke else ROWS)
    if args.objective == "decode" and args.rows[0] > DECODE_ROWS:
        parser.error(f"argument --objective decode: --rows needs an M <= {DECODE_ROWS}, got {args.rows}")
    log = Log(args.out or Path(os.environ.get("OUT") or ".") / "tune_matmul.log")
    start, summaries = time.monotonic(), []
    counts = [len(projections(m, small=args.smoke)) for m in models]
    for i, model in enumerate(models):
        summaries += tune_model(model, args, log, start, (sum(counts[:i]), sum(counts)))
    for line in summaries + [f"full log: {log.path} ({time.monotonic() - start:.0f} s)"]:
        log(line)
    log.file.close()


if __name__ == "__main__":
    main(sys.argv[1:])

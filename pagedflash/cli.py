"""``python -m pagedflash``: the demo and the benchmark suite.

    pagedflash demo                          kernel checks table, then the serving-engine demo
    pagedflash serve [MODEL_DIR] [ARGS...]   the OpenAI-compatible HTTP server (needs the serve extra)
    pagedflash bench prefill|decode|paged    one benchmark: tables on stdout, JSON + PNG under --out
    pagedflash bench overhead                host time per eager call, ours and SDPA's (CPU too)
    pagedflash bench moe                     the fused MoE layer against a per-expert loop and its bounds
    pagedflash bench serve [ARGS...]         the serving benchmark (extra ARGS go to it)
    pagedflash bench online [ARGS...]        HTTP load on an OpenAI-compatible server (ARGS go to it)
    pagedflash bench tune [ARGS...]          launch-choice sweep (developer tool, ARGS go to it)
    pagedflash bench invariance [ARGS...]    batch-invariant mode under load: greedy outputs vs each request alone
    pagedflash bench all                     prefill, decode, paged, overhead, moe, serve in turn

Benchmarks need a CUDA GPU; ``--quick`` runs tiny shapes anywhere (on a CPU under the Triton
interpreter, in seconds) to check the plumbing, not to produce figures. ``--batch-invariant``
(decode, prefill, serve, all): each timed point also in the batch-invariant mode, same run, with
the on/off time ratio (README "Batch invariance"). Exit status: 0 all passed,
1 a kernel failed its correctness check (its figures are not reported), 2 usage / no GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

KERNEL_BENCHES = ("prefill", "decode", "paged", "overhead", "moe")
CPU_BENCHES = ("overhead", "online")  # meaningful without a GPU, no --quick needed
FORWARDED = ("serve", "tune", "online", "invariance")  # modules with their own main(argv); extra arguments go to them
INVARIANT_COST = ("decode", "prefill", "serve", "all")  # benches that take --batch-invariant
BENCHES = (*KERNEL_BENCHES, *FORWARDED, "all")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedflash", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="check every kernel against the reference, then run the engine demo")
    sub.add_parser("serve", add_help=False,  # its options are the server's own (pagedflash serve --help)
                   help="the OpenAI-compatible HTTP server: pagedflash serve [MODEL_DIR] [--port N] ...")
    bench = sub.add_parser("bench", help="run a benchmark (needs a GPU unless --quick)")
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("--out", type=Path, default=Path("bench_results"), help="where JSON and PNG go")
    bench.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run, not figures")
    bench.add_argument("--rep-ms", type=int, default=100, help="do_bench timing budget per case, ms")
    bench.add_argument("--warmup-ms", type=int, default=25, help="do_bench warmup budget per case, ms")
    bench.add_argument("--flush", choices=("zero", "read"), default="zero",
                       help="L2 before each timed call: zeroed by do_bench (default; L2 left dirty, written back as "
                            "the call reads) or a 256 MB read (L2 left clean: the absolute figures of small cases)")
    bench.add_argument("--eager", action="store_true",
                       help="time eager calls instead of CUDA-graph replays (includes host launch overhead)")
    bench.add_argument("--batch-invariant", action="store_true",
                       help=f"{'/'.join(INVARIANT_COST)}: time each point with the batch-invariant mode off and on, "
                            "same run, and report the on/off time ratio")
    return parser


def _run_kernel_bench(name: str, cfg) -> int:
    import importlib

    module = importlib.import_module(f"pagedflash.bench.{name}")
    t0 = time.perf_counter()
    rc = module.main(cfg)
    print(f"bench {name}: {time.perf_counter() - t0:.0f} s, exit {rc}", flush=True)
    return rc


def _run_forwarded(name: str, cfg, extra: list[str]) -> int:
    """``bench serve`` / ``bench tune``: modules with their own ``main(argv)``, imported only here so a
    missing or broken engine never breaks the kernel benches."""
    import importlib

    try:
        module = importlib.import_module(f"pagedflash.bench.{name}")
    except ImportError as e:
        print(f"bench {name}: unavailable ({e})", file=sys.stderr)
        return 1
    argv = ["--out", str(cfg.out), *(["--quick"] if cfg.quick and name in ("serve", "online", "invariance") else []),
            *(["--batch-invariant"] if cfg.batch_invariant and name == "serve" else []), *extra]
    try:
        rc = module.main(argv)
    except SystemExit as e:  # its own argparse
        rc = e.code if isinstance(e.code, int) else 1
    return rc or 0


def _bench(args, extra: list[str]) -> int:
    from pagedflash.bench import common, hbm

    if extra and args.name not in FORWARDED:
        print(f"pagedflash bench {args.name}: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    if args.batch_invariant and args.name not in INVARIANT_COST:
        print(f"pagedflash bench {args.name}: --batch-invariant is for {', '.join(INVARIANT_COST)} "
              "(bench invariance always runs both modes)", file=sys.stderr)
        return 2
    if not common.has_gpu() and not args.quick and args.name not in CPU_BENCHES:
        print("pagedflash bench: the benchmarks need a CUDA GPU and none is visible. "
              "Use --quick for a smoke run on tiny shapes (CPU: Triton interpreter).", file=sys.stderr)
        return 2
    try:  # every result file records it (env.hbm): a bad PAGEDFLASH_HBM_TBPS is refused before anything runs
        hbm.hbm_bandwidth()
    except ValueError as e:
        print(f"pagedflash bench: {e}", file=sys.stderr)
        return 2
    common.set_timing(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, graphs=not args.eager, flush=args.flush)
    cfg = common.Config(out=args.out, quick=args.quick, batch_invariant=args.batch_invariant)
    if args.name in FORWARDED:
        return _run_forwarded(args.name, cfg, extra)
    names = KERNEL_BENCHES if args.name == "all" else (args.name,)
    codes = [_run_kernel_bench(name, cfg) for name in names]
    if args.name == "all":
        codes.append(_run_forwarded("serve", cfg, []))
        common.free_memory()
    return max(codes)


def _demo() -> int:
    from pagedflash import demo

    rc = demo.main()
    try:
        from pagedflash.engine.demo import run_demo
    except ImportError as e:
        print(f"note: the serving-engine demo is not available ({e}); kernel checks only.")
        return rc
    result = run_demo()
    return rc or (result if isinstance(result, int) else 0)


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(argv)
    if args.command == "demo":
        if extra:
            print(f"pagedflash demo: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
            return 2
        return _demo()
    if args.command == "serve":
        from pagedflash.entrypoints.openai.api_server import main as serve

        return serve(extra)
    return _bench(args, extra)

"""Where the engine's throughput run spends its device time, batch-invariant mode off and on (issue 32):
the workload of ``pagedflash bench serve --sections throughput`` (256 requests, prompts 100-1024,
outputs 100-1024, random 1B Llama weights), run once outside the profiler for its wall time, then
once more (other tokens) under ``torch.profiler`` with the kernels' self CUDA time grouped by kind
(GEMM, attention, norms, ...).

    python tools/profile_throughput.py [--num-requests N] [--modes off,on] [--top 20]
    python tools/profile_throughput.py --smoke     # a tiny model on the CPU interpreter (checks the script)

Printed per mode: the wall time and output tok/s, the steps, the kernels' total time and its share of
the wall time (the rest: the host, gaps between launches), each run's slowest steps (a compile or an
allocation mid-run shows as one), each kind's ms and share, the top kernels;
then each kind's ms mode on over off (which kinds the mode's extra time is in).
"""
from __future__ import annotations

import argparse
import random
import re
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine.config import LLAMA_3_2_1B, TINY_LLAMA

# kernel-name patterns by kind, first match wins
KINDS = (
    ("GEMM cuBLAS", r"gemm|cutlass|xmma|nvjet|cublas|splitk"),
    ("GEMM invariant", r"_matmul_kernel|_fold_kernel"),
    ("gemv", r"gemv"),
    ("attention", r"attention|combine|prefill|gluon|_attend"),
    ("norm", r"norm"),
    ("rope", r"rope"),
    ("cache write", r"cache|write_kv"),
    ("sampling", r"sampl|topk|sort|argmax|softmax|multinomial|exponential|scatter|gather"),
    ("activation", r"silu|act_|swiglu|gelu"),
)


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, low)), "other")


def workload(n: int, vocab: int, seed: int, sizes: tuple[int, int]):
    """``n`` prompts of ``sizes`` random tokens, each with ``sizes`` output tokens; the lengths follow
    ``n`` only, the tokens ``seed`` too."""
    lengths, tokens = random.Random(n), random.Random(seed)
    lens = [(lengths.randint(*sizes), lengths.randint(*sizes)) for _ in range(n)]
    prompts = [[tokens.randrange(3, vocab) for _ in range(p)] for p, _ in lens]
    return prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in lens]


class StepTimes:
    """Wraps ``llm.step``: each step's wall time, the prompt tokens it computed and the rows running
    after it, for the slowest steps of a run (a compile or an allocation mid-run shows as one)."""

    def __init__(self, llm: LLM):
        self.llm, self.step, self.rows = llm, llm.step, []
        llm.step = self

    def __call__(self):
        before = self.llm.counters["computed_prefill_tokens"]
        t0 = time.perf_counter()
        out = self.step()
        self.rows.append((time.perf_counter() - t0, self.llm.counters["computed_prefill_tokens"] - before,
                          len(self.llm.scheduler.running)))
        return out

    def take(self, label: str, count: int = 8) -> str:
        """The steps since the last take: their count, median and slowest, as a line."""
        rows, self.rows = self.rows, []
        times = sorted(r[0] for r in rows) or [0.0]
        slowest = ", ".join(f"({1e3 * t:.1f}, {p}, {n})" for t, p, n in sorted(rows, reverse=True)[:count])
        return (f"  {label}: {len(rows)} steps, median {1e3 * times[len(times) // 2]:.2f} ms; slowest (ms, prompt "
                f"tokens, rows): {slowest}")


def check(outputs) -> None:
    """Every request ran (a refused one would make the run look fast)."""
    failed = [o for o in outputs if o.finish_reason == "error"]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")


def run_mode(model, invariant: bool, timed, profiled, top: int) -> dict[str, float]:
    """Two workloads of the same sizes (other tokens: the second meets no cached prefix)."""
    llm = LLM(model, max_num_seqs=256, max_num_batched_tokens=8192, batch_invariant=invariant)
    rng = random.Random(1)
    warm = llm.generate([[rng.randrange(3, model["vocab_size"]) for _ in range(300)]] + [[5, 6, 7]] * 3,
                        SamplingParams(max_tokens=4, ignore_eos=True))  # compile every shape class
    check(warm)
    steps = StepTimes(llm)
    t0 = time.perf_counter()
    check(llm.generate(*timed))
    wall = time.perf_counter() - t0
    stats = dict(llm.last_stats)
    timed_steps = steps.take("timed run")
    gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        check(llm.generate(*profiled))
        if gpu:
            torch.cuda.synchronize()
        prof_wall = time.perf_counter() - t0
    by_kind: dict[str, float] = defaultdict(float)
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if gpu else e.self_cpu_time_total
        if us > 0:
            by_kind[kind(e.key)] += us / 1e3
            rows.append((us / 1e3, e.count, e.key))
    total = sum(by_kind.values())
    mode = "on" if invariant else "off"
    print(f"\n== batch-invariant mode {mode}: {wall:.2f} s ({stats['output_tokens'] / wall:.0f} output tok/s), "
          f"{stats['steps']} steps; profiled run {prof_wall:.2f} s, kernels {total / 1e3:.2f} s "
          f"({100 * total / 1e3 / prof_wall:.0f} % of it)")
    print(timed_steps)
    print(steps.take("profiled run"))
    for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:16s} {ms:9.1f} ms  {100 * ms / total:5.1f} %")
    print(f"  top {top} kernels (self device ms, calls):")
    for ms, count, name in sorted(rows, reverse=True)[:top]:
        print(f"    {ms:9.1f} {count:7d}  {name[:110]}")
    llm.close()
    del llm
    if gpu:
        torch.cuda.empty_cache()
    return dict(by_kind, _wall=wall * 1e3, _kernels=total)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--modes", default="off,on", type=lambda text: text.split(","),
                   help="comma-separated of off, on")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="a tiny model, 3 short requests (CPU: ops' self CPU time)")
    args = p.parse_args()
    if not args.modes or not set(args.modes) <= {"off", "on"}:
        p.error(f"--modes: expected a comma-separated list of off and on, got {','.join(args.modes)!r}")
    model, n, sizes = (TINY_LLAMA, 3, (4, 12)) if args.smoke else (LLAMA_3_2_1B, args.num_requests, (100, 1024))
    timed, profiled = (workload(n, model["vocab_size"], seed, sizes) for seed in (0, 1))
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{n} requests, {sum(map(len, timed[0]))} prompt tokens, {sum(s.max_tokens for s in timed[1])} output "
          f"tokens; {where}")
    got = {m: run_mode(model, m == "on", timed, profiled, args.top) for m in args.modes}
    if len(got) == 2:
        off, on = got["off"], got["on"]
        print("\n== mode on - off, ms (and on / off) by kind")
        for k in sorted(set(off) | set(on), key=lambda k: -(on.get(k, 0) - off.get(k, 0))):
            a, b = off.get(k, 0.0), on.get(k, 0.0)
            print(f"  {k:16s} {b - a:+9.1f}  ({b:.1f} / {a:.1f}{f' = {b / a:.2f}' if a else ''})")


if __name__ == "__main__":
    main()

"""The sampler's host cost: wall time and top-level torch ops of one ``sample`` call over R sampled rows
(temperature 0.7, top-p 0.9; on the CPU, or on a GPU with ``--device cuda``), for this tree's sampler and,
with ``--against FILE``, another version of ``pagedflash/engine/sampling.py`` (e.g. ``git show
701d1a5:pagedflash/engine/sampling.py > /tmp/old.py``: the per-row loop).

    python tools/sampler_host_time.py [--vocab 32000] [--device cpu] [--against /tmp/old.py]
"""

import argparse
import importlib.util
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagedflash.engine import sampling

ap = argparse.ArgumentParser()
ap.add_argument("--vocab", type=int, default=32000)
ap.add_argument("--device", default="cpu")
ap.add_argument("--against", help="another sampling.py to time beside this tree's")
args = ap.parse_args()
versions = [("this tree", sampling)]
if args.against:
    spec = importlib.util.spec_from_file_location("sampling_other", args.against)
    other = importlib.util.module_from_spec(spec)
    sys.modules["sampling_other"] = other
    spec.loader.exec_module(other)
    versions.insert(0, (args.against, other))
torch.manual_seed(0)
V = args.vocab
for R in (1, 8, 64, 256):
    logits = torch.randn(R, V, device=args.device)
    for name, mod in versions:
        P = mod.SamplingParams
        params = [P(temperature=0.7, top_p=0.9) for _ in range(R)]
        gen = torch.Generator(device=args.device).manual_seed(0)
        mod.sample(logits, params, [None] * R, gen)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            mod.sample(logits, params, [None] * R, gen)
        ops = sum(1 for e in prof.events() if e.cpu_parent is None)  # top-level ops
        times = []
        for _ in range(5):
            t = time.perf_counter()
            mod.sample(logits, params, [None] * R, gen).tolist()
            times.append(time.perf_counter() - t)
        print(f"R={R:4d} V={V} {name}: {min(times) * 1e3:8.2f} ms, {ops} top-level torch ops")

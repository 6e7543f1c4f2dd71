"""Host cost of one engine decode step (scheduler, metadata, sampling, bookkeeping) with the model's
forward, LM head and argmax stubbed out, so only the Python around them is timed. Run from the repo root:
``python tools/engine_host_cost.py`` (CPU is fine)."""
import sys
import tempfile
import time

import torch

sys.path.insert(0, "tests")
from test_engine import save_tiny  # noqa: E402

import pagedflash  # noqa: E402,F401  (first: sets the interpreter on CPU-only machines)
from pagedflash.engine import LLM, SamplingParams  # noqa: E402

path = tempfile.mkdtemp()
save_tiny(path)
llm = LLM(path, dtype=torch.float32, page_size=16, num_blocks=4096, max_num_seqs=64)
r = llm.runner
hidden = r.model.config.hidden_size
# stub the GPU parts: prefill forwards return zeros, a decode step (forward, LM head, argmax) does nothing
r.model.forward = lambda ids, pos, meta, kv: torch.zeros(ids.shape[0], hidden)
r._decode_step = lambda bs, meta: None
for batch in (1, 32):
    prompts = [[5] * 20 for _ in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=80, ignore_eos=True))
    el = time.perf_counter() - t
    steps = llm.last_stats["steps"]
    print(f"batch {batch}: {1e6 * el / steps:.0f} us host per step ({steps} steps)")

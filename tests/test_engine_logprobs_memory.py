"""The memory of logprobs: the log-softmax of a long prompt chunk's logits runs in slices of
:data:`~pagedflash.engine.logprobs.ROWS_PER_GATHER` rows, bitwise equal to one slice of all rows;
and the engine's activation profile (:func:`~pagedflash.engine.executor.largest_step`) runs the
step of largest logprob work, logits of every position of max_num_batched_tokens tokens and their
log-softmax, so the KV pool is sized next to it. (The profile's peak itself is measured on a GPU.)"""

import pytest
import torch

from pagedflash.engine import LLM
from pagedflash.engine import logprobs as logprobs_mod
from pagedflash.engine.config import TINY_LLAMA
from pagedflash.engine.executor import EngineSpec, largest_step
from pagedflash.engine.sampling import MAX_LOGPROBS

VOCAB = 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 3, MAX_LOGPROBS])
def test_sliced_log_softmax_is_bitwise_the_unsliced_one(monkeypatch, dtype, k):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(41, VOCAB, generator=g) * 4).to(dtype)
    rows = torch.randperm(41, generator=g)[:37].tolist()
    targets = torch.randint(0, VOCAB, (len(rows),), generator=g)
    monkeypatch.setattr(logprobs_mod, "ROWS_PER_GATHER", 1 << 30)
    whole = logprobs_mod.gather(logits, rows, targets, k)
    for rows_per_slice in (1, 5, 36, 37):
        monkeypatch.setattr(logprobs_mod, "ROWS_PER_GATHER", rows_per_slice)
        assert torch.equal(logprobs_mod.gather(logits, rows, targets, k), whole)
    assert whole.shape == (len(rows) * (1 + 2 * k),)


def test_the_profiled_step_computes_logprobs_of_every_position():
    """7 sequences over 60 tokens: 53 prompt entries and 7 sampled ones, top MAX_LOGPROBS each."""
    config = {**TINY_LLAMA, "vocab_size": VOCAB, "max_position_embeddings": 64}
    llm = LLM(config, dtype=torch.float32, seed=0, page_size=8, num_blocks=16)
    spec = EngineSpec(config=llm.config, path=None, seed=0, dtype=torch.float32, device=torch.device("cpu"),
                      max_model_len=64, page_size=8, num_blocks=None, max_num_seqs=7, max_num_batched_tokens=60,
                      cuda_graphs=False, gpu_memory_utilization=0.9)
    runner, batch = largest_step(llm.model, spec, spec.device)
    assert [row.num_tokens for row in batch.rows] == [9, 9, 9, 9, 8, 8, 8]
    want = logprobs_mod.plan(batch, VOCAB)
    assert len(want.prompt_positions) == 60 - 7 and len(want.sampled) == 7
    pending = runner.launch(batch)
    assert len(pending.result()) == 7
    step = pending.logprobs
    assert sum(len(entries) for entries in step.prompt.values()) == 53 and len(step.sampled) == 7
    assert all(len(entry) >= MAX_LOGPROBS for entry in step.sampled.values())

"""The memory of logprobs and of the engine's activation profile.

A prefill step's prompt positions go through the LM head in slices of
:data:`~pagedflash.engine.logprobs.ROWS_PER_GATHER` rows, each slice's log-softmax and top k taken
before the next slice's logits exist: the largest logits tensor of a step is bounded by the slice
(and the sampling rows), not by the step's token count. Slicing changes no entry: each row's
reduction is its own (bitwise, given the same logits), and a batch-invariant engine's entries are
bitwise the same for every slice size; in the default mode the host BLAS may round a row by the
rows beside it, so there the entries are checked against the reference of
tests/test_engine_logprobs.py (``LLM.prompt_logits``, within its ``ATOL``). The profile
(:func:`~pagedflash.engine.executor.largest_step`) runs the step of largest logprob work, and adds
the split partials a batch-invariant engine's decode graphs hold (:func:`graph_split_bytes`, checked
here against the partials the capture bodies allocate). (The profile's peak itself is measured on a
GPU.)"""

import pytest
import torch
from test_engine_logprobs import ATOL, check_entry, tokens

from pagedflash.engine import LLM, SamplingParams
from pagedflash.engine import logprobs as logprobs_mod
from pagedflash.engine import runner as runner_mod
from pagedflash.engine.config import TINY_LLAMA
from pagedflash.engine.executor import EngineSpec, build_rank, graph_split_bytes, largest_step
from pagedflash.engine.sampling import MAX_LOGPROBS
from pagedflash.ops import scratch
from pagedflash.ops.launch import INTERPRET_SPLIT_RULE, INVARIANT_MAX_SPLITS, SplitRule
from pagedflash.ops.utils import num_sms
from pagedflash.testing import row_exact_interpreter_dot

VOCAB = 128
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIG = {**TINY_LLAMA, "vocab_size": VOCAB, "max_position_embeddings": 256, "initializer_range": 0.3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 3, MAX_LOGPROBS])
def test_sliced_log_softmax_is_bitwise_the_unsliced_one(dtype, k):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(41, VOCAB, generator=g) * 4).to(dtype)
    rows = torch.randperm(41, generator=g)[:37].tolist()
    targets = torch.randint(0, VOCAB, (len(rows),), generator=g)
    whole = logprobs_mod.gather(logits.__getitem__, rows, targets, k, 1 << 30)
    asked = []
    for rows_per_slice in (1, 5, 36, 37):
        asked.clear()
        got = logprobs_mod.gather(lambda idx: asked.append(idx.tolist()) or logits[idx], rows, targets, k,
                                  rows_per_slice)
        assert torch.equal(got, whole)
        assert sum(asked, []) == rows and max(map(len, asked)) == rows_per_slice
    assert whole.shape == (len(rows) * (1 + 2 * k),)


def spec_of(llm: LLM, *, tokens: int, seqs: int, **kw) -> EngineSpec:
    return EngineSpec(**{**dict(config=llm.config, path=None, seed=0, dtype=torch.float32, device=DEVICE,
                                max_model_len=CONFIG["max_position_embeddings"], page_size=8, num_blocks=None,
                                max_num_seqs=seqs, max_num_batched_tokens=tokens, cuda_graphs=False,
                                gpu_memory_utilization=0.9), **kw})


def test_the_profiled_step_computes_logprobs_of_every_position():
    """7 sequences over 60 tokens: 53 prompt entries and 7 sampled ones, top MAX_LOGPROBS each."""
    llm = LLM(CONFIG, dtype=torch.float32, seed=0, page_size=8, num_blocks=16, device=DEVICE)
    runner, batch = largest_step(llm.model, spec_of(llm, tokens=60, seqs=7), DEVICE)
    assert [row.num_tokens for row in batch.rows] == [9, 9, 9, 9, 8, 8, 8]
    want = logprobs_mod.plan(batch, VOCAB)
    assert len(want.prompt_positions) == 60 - 7 and len(want.sampled) == 7
    pending = runner.launch(batch)
    assert len(pending.result()) == 7
    step = pending.logprobs
    assert sum(len(entries) for entries in step.prompt.values()) == 53 and len(step.sampled) == 7
    assert all(len(entry) >= MAX_LOGPROBS for entry in step.sampled.values())


def test_the_largest_logits_do_not_grow_with_the_step(monkeypatch):
    """The profiled step (every position asking for logprobs) at 40 and 100 tokens, slices of 8
    rows: every LM head call of the step is at most max(8, sampling rows) rows, the prompt positions
    pass through it once each, and the largest logits tensor is the same at both sizes; the entries
    equal those of one slice of all rows (within ATOL: the host BLAS) and of the reference."""
    monkeypatch.setattr(logprobs_mod, "ROWS_PER_GATHER", 8)
    llm = LLM(CONFIG, dtype=torch.float32, seed=0, page_size=8, num_blocks=16, device=DEVICE)
    reference = LLM(CONFIG, dtype=torch.float32, seed=0, page_size=8, num_blocks=64, enable_prefix_caching=False,
                    device=DEVICE)
    lm_logits, shapes = llm.model.lm_logits, []
    monkeypatch.setattr(llm.model, "lm_logits", lambda h: shapes.append(tuple(h.shape)) or lm_logits(h))
    largest = {}
    for total in (40, 100):
        shapes.clear()
        runner, batch = largest_step(llm.model, spec_of(llm, tokens=total, seqs=7), DEVICE)
        step = runner.launch(batch).logprobs
        assert shapes[0] == (7, CONFIG["hidden_size"])  # the sampling rows, whole
        assert all(rows <= 8 for rows, _ in shapes[1:]) and sum(rows for rows, _ in shapes[1:]) == total - 7
        largest[total] = max(rows for rows, _ in shapes)
        monkeypatch.setattr(logprobs_mod, "ROWS_PER_GATHER", 1 << 30)
        runner, batch = largest_step(llm.model, spec_of(llm, tokens=total, seqs=7), DEVICE)
        whole = runner.launch(batch).logprobs
        monkeypatch.setattr(logprobs_mod, "ROWS_PER_GATHER", 8)
        for i, entries in step.prompt.items():
            assert [list(e) for e in entries] == [list(e) for e in whole.prompt[i]]
            assert all(abs(e[t] - w[t]) <= ATOL for e, w in zip(entries, whole.prompt[i]) for t in e)
        assert step.sampled == whole.sampled  # the sampling rows' logits are not sliced
        seq = batch.rows[0].seq
        ref = reference.prompt_logits([seq.token_ids])[0].log_softmax(-1)
        for j, entry in enumerate(step.prompt[0]):
            check_entry(entry, seq.token_ids[j + 1], ref[j], MAX_LOGPROBS, f"prompt token {j + 1}")
    assert largest[40] == largest[100] == 8


@pytest.mark.parametrize("engine_kw", [{}, {"batch_invariant": True}], ids=["default", "batch_invariant"])
def test_slices_give_the_entries_of_one_slice(monkeypatch, engine_kw):
    """Requests with long prompt logprobs, chunked (40 tokens a step), served with slices of 5 and of
    all rows: the same tokens and keys, values within ATOL; bitwise equal in batch-invariant mode
    (its projections go one row at a time off the GPU; its attention dot row-exact)."""
    prompts = [tokens(n, 60 + n) for n in (23, 31, 2, 17)]
    params = [SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=4),
              SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3),
              SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0, seed=3, logprobs=1, prompt_logprobs=0)]
    runs = {}
    with row_exact_interpreter_dot():
        for rows in (1 << 30, 5):
            monkeypatch.setattr(logprobs_mod, "ROWS_PER_GATHER", rows)
            llm = LLM(CONFIG, dtype=torch.float32, seed=0, page_size=4, num_blocks=64, max_num_batched_tokens=40,
                      **engine_kw)
            runs[rows] = [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(prompts, params)]
    whole = runs.pop(1 << 30)
    for rows, outs in runs.items():
        if engine_kw:
            assert outs == whole, f"slices of {rows}"
            continue
        for got, want in zip(outs, whole):
            assert got[0] == want[0] and got[1] == want[1]  # sampled: not sliced
            assert len(got[2]) == len(want[2]) and got[2][0] is None
            for x, y in zip(got[2][1:], want[2][1:]):
                assert list(x) == list(y) and all(abs(x[t] - y[t]) <= ATOL for t in x), f"slices of {rows}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's split size and nominal SM count")
def test_graph_split_bytes_are_the_capture_bodies_partials(monkeypatch):
    """A batch-invariant engine on the CPU (16 nominal SMs, 2 KV heads: graphs of 1, 2, 4 and 8
    rows split; 256 keys under the interpreter's rule: 4 head splits of 16 keys, then 6 of 32): each capture body's split
    partials, one shape per graph, are what :func:`graph_split_bytes` counts (each graph's warm-up
    set kept, plus the largest in the graphs' pool); nothing without the mode, without graphs, or
    when the launch takes no split (one split's worth of keys, or more than ``INVARIANT_MAX_SPLITS`` splits)."""
    llm = LLM(CONFIG, dtype=torch.float32, seed=0, page_size=8, num_blocks=16)
    spec = spec_of(llm, tokens=64, seqs=8, batch_invariant=True, cuda_graphs=True)
    rank = build_rank(spec)
    per_graph, current = {}, []
    buffers = scratch.buffers

    def record(specs, device):
        if len(specs) == 2 and all(dtype == torch.float32 for _, dtype in specs):  # attention's (out, lse) partials
            current.append(sum(torch.Size(shape).numel() * 4 for shape, _ in specs))
        return buffers(specs, device)

    def capture(body, pool):
        current.clear()
        body()
        return None, pool

    monkeypatch.setattr(scratch, "buffers", record)
    monkeypatch.setattr(runner_mod, "capture", capture)
    decode_step = rank.runner._decode_step
    monkeypatch.setattr(rank.runner, "_decode_step", lambda bs, meta: (decode_step(bs, meta),
                                                                       per_graph.setdefault(bs, set(current))))
    rank.runner.capture_graphs()
    assert sorted(per_graph) == [1, 2, 4, 8]
    assert all(len(b) == 1 for b in per_graph.values()), per_graph  # one shape for every layer
    sizes = {bs: b.pop() for bs, b in per_graph.items()}
    heads, dim = CONFIG["num_attention_heads"], CONFIG["head_dim"]
    rule = SplitRule(*INTERPRET_SPLIT_RULE)
    splits = rule.count(CONFIG["max_position_embeddings"])
    assert splits == 10
    assert sizes == {bs: (splits * (dim + 1) + 1) * bs * heads * 4 for bs in sizes}  # + the rows' split counts
    assert graph_split_bytes(rank.model, spec, num_sms(spec.device)) == sum(sizes.values()) + max(sizes.values())
    for off in (dict(batch_invariant=False, cuda_graphs=True), dict(batch_invariant=True, cuda_graphs=False),
                dict(batch_invariant=True, cuda_graphs=True, max_model_len=rule.head_split),  # one split
                dict(batch_invariant=True, cuda_graphs=True,  # one split past the cap
                     max_model_len=rule.head_keys + (INVARIANT_MAX_SPLITS + 1 - rule.count(rule.head_keys)) * rule.keys)):
        assert graph_split_bytes(rank.model, spec_of(llm, tokens=64, seqs=8, **off), 16) == 0, off

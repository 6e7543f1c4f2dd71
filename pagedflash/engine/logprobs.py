"""Logprobs of sampled and prompt tokens (``SamplingParams.logprobs`` / ``prompt_logprobs``).

A step whose rows ask for none does nothing here beyond one check per row (:func:`plan` returns
None): no device work, no transfer, and decode steps keep their CUDA graphs and run-ahead.

A step with such rows samples synchronously (the runner never defers its tokens, so no step is
launched ahead after it). :func:`plan` says which positions need logprobs: the sampling position of
a row asking for ``logprobs``, and the positions of a prefill chunk whose next token is a prompt
token not covered yet (position ``i`` gives the entry of prompt token ``i + 1``; the first prompt
token has none). :func:`prompt` (prompt positions, in the runner's forward) and :func:`read`
(sampling rows) compute, on the device and for those rows only, the fp32 log-softmax of the logits
as the model gave them (before the sampler's bias, penalties, temperature and filters), the target token's value and the top ``k``
(``torch.topk``, largest first); :func:`read` brings them to the host together with the sampled
tokens in one transfer (float64: token ids below 2**53 and fp32 values are exact).

Memory: prompt positions are reduced in slices of :data:`ROWS_PER_GATHER` rows (:func:`prompt`):
a slice's logits (the LM head of its hidden rows, model dtype, gathered over the ranks), their fp32
copy, log-softmax and top k, then the next slice; so a chunk of ``T`` prompt positions never holds
more than ``ROWS_PER_GATHER x vocab`` logits at once, not ``T x vocab``. Each row's values are its
own reduction (bitwise those of one slice of all rows, given the same logits; a row's LM head output
may depend on the rows beside it through the BLAS, except in batch-invariant mode). The sampling
rows' logits ``[S, vocab]`` come whole from the runner (the sampler needs them). The engine's
activation profile (:func:`~pagedflash.engine.executor.largest_step`) runs a step of
max_num_batched_tokens positions all asking for logprobs, so the KV pool is sized next to that bound.

Prompt tokens served from the prefix cache have no logits. A request asking for
``prompt_logprobs`` is admitted with those positions to compute again (as vLLM, which skips the
prefix cache for such requests): the scheduler starts it at the first position whose entry is
missing, but it keeps the cached pages, and the recomputed positions inside them write no K/V
(slot -1, :attr:`LogprobPlan.unwritten`): a shared page is never written, and their queries read
the cached keys and values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedflash.engine.sampling import to_device

ROWS_PER_GATHER = 1024  # logits rows per slice of prompt positions: bounds their logits and log-softmax

Logprobs = dict[int, float]  # token id -> logprob: the target token first, then the top k (largest first)


@dataclass
class StepLogprobs:
    """The logprobs of one step, by the index of the row in its batch."""

    sampled: dict[int, Logprobs] = field(default_factory=dict)  # the sampled token's entry of each row asking
    prompt: dict[int, list[Logprobs]] = field(default_factory=dict)  # the prompt entries each chunk computed


@dataclass
class LogprobPlan:
    """Which of a step's positions need logprobs. Packed indices count the step's tokens in row
    order (a decode step: one per row)."""

    sampled: list[tuple[int, int, int]] = field(default_factory=list)  # (batch row, sampling row, k)
    prompt: list[tuple[int, int, int]] = field(default_factory=list)  # (batch row, number of positions, k)
    prompt_positions: list[int] = field(default_factory=list)  # packed index of each prompt position
    prompt_targets: list[int] = field(default_factory=list)  # the prompt token each of them predicts
    unwritten: list[tuple[int, int]] = field(default_factory=list)  # (packed index, count): slot -1
    # prompt positions per slice: fixed when planned on rank 0, so every rank slices alike
    slice_rows: int = field(default_factory=lambda: ROWS_PER_GATHER)


def plan(batch, vocab_size: int) -> LogprobPlan | None:
    """What ``batch`` (a :class:`~pagedflash.engine.scheduler.Batch`) computes for logprobs, or None
    when it computes none (a request's decode steps after its prompt logprobs keep their run-ahead)."""
    if not any(row.seq.asks_logprobs for row in batch.rows):
        return None
    out = LogprobPlan()
    packed = sampling = 0
    for i, row in enumerate(batch.rows):
        seq = row.seq
        k = seq.params.logprobs
        if row.samples:
            if k is not None:
                out.sampled.append((i, sampling, min(k, vocab_size)))
            sampling += 1
        if row.start < seq.num_prefix_hit:  # recomputed for prompt logprobs inside a shared page
            out.unwritten.append((packed, min(row.end, seq.num_prefix_hit) - row.start))
        entries = seq.prompt_logprobs
        if entries is not None:
            first, last = max(row.start, len(entries) - 1), min(row.end, seq.num_prompt_tokens - 1)
            if first < last:
                out.prompt.append((i, last - first, min(seq.params.prompt_logprobs, vocab_size)))
                out.prompt_positions += range(packed + first - row.start, packed + last - row.start)
                out.prompt_targets += seq.token_ids[first + 1 : last + 1]
        packed += row.num_tokens
    return out if out.sampled or out.prompt or out.unwritten else None


def gather(logits_of: Callable[[torch.Tensor], torch.Tensor], rows: list[int], targets: torch.Tensor, k: int,
           slice_rows: int | None = None, read: bool = True) -> torch.Tensor | None:
    """For each row ``r`` of ``rows``: the fp32 log-softmax of its logits at its target, then the
    ``k`` largest values' token ids and values. ``logits_of(idx)``: the logits ``[len(idx), V]`` (any
    float dtype) of the rows ``idx`` (int64, on ``targets``' device), asked for in order, ``slice_rows``
    rows at a time (default :data:`ROWS_PER_GATHER`); ``targets`` int64 ``[len(rows)]``. Returns
    float64 ``[len(rows) * (1 + 2k)]``, row by row; with ``read`` False (a tensor-parallel rank whose
    entries nobody reads) only asks for the logits, as a gather over the ranks needs, and returns None."""
    step = slice_rows or ROWS_PER_GATHER
    parts = []
    for a in range(0, len(rows), step):
        logits = logits_of(to_device(rows[a : a + step], torch.int64, targets.device))
        if not read:
            continue
        lp = torch.log_softmax(logits.float(), dim=-1)
        cols = [lp.gather(1, targets[a : a + step, None])]
        if k:
            top = lp.topk(k, dim=-1)
            cols += [top.indices, top.values]
        parts.append(torch.cat([c.double() for c in cols], dim=1).flatten())
    return torch.cat(parts) if read else None


def prompt(want: LogprobPlan, logits_of: Callable[[torch.Tensor], torch.Tensor], device,
           read: bool = True) -> torch.Tensor | None:
    """:func:`gather` of ``want``'s prompt positions (``logits_of``: as there, by packed index) in
    slices of ``want.slice_rows``, on ``device``; None when it has none. Every rank of a
    tensor-parallel engine calls it with the same ``want`` (``logits_of`` may gather over the ranks:
    the same slices everywhere); only rank 0's entries are read (``read`` False elsewhere)."""
    if not want.prompt:
        return None
    return gather(logits_of, want.prompt_positions, to_device(want.prompt_targets, torch.int64, device), _width(want.prompt),
                  want.slice_rows, read)


def read(want: LogprobPlan, tokens: torch.Tensor, sample_logits: torch.Tensor,
         prompt_values: torch.Tensor | None) -> tuple[list[int], StepLogprobs]:
    """The step's sampled tokens and its logprobs, in one device-to-host transfer.

    ``tokens`` int64 ``[S]``: the sampled token of each sampling row, whose logits are
    ``sample_logits [S, V]``. ``prompt_values``: :func:`prompt`'s result for ``want``."""
    parts = [tokens.double()]
    k_sampled, k_prompt = _width(want.sampled), _width(want.prompt)
    if want.sampled:
        rows = [s for _, s, _ in want.sampled]
        parts.append(gather(sample_logits.__getitem__, rows, tokens[to_device(rows, torch.int64, tokens.device)], k_sampled))
    if want.prompt:
        parts.append(prompt_values)
    values = torch.cat(parts).tolist()  # the one transfer (and sync) of the step
    n = tokens.shape[0]
    step = StepLogprobs()
    at = n
    for i, s, k in want.sampled:
        step.sampled[i] = _entry(int(values[s]), values, at, k, k_sampled)
        at += 1 + 2 * k_sampled
    targets = iter(want.prompt_targets)
    for i, count, k in want.prompt:
        entries = []
        for _ in range(count):
            entries.append(_entry(next(targets), values, at, k, k_prompt))
            at += 1 + 2 * k_prompt
        step.prompt[i] = entries
    return [int(t) for t in values[:n]], step


def _width(items: list[tuple[int, int, int]]) -> int:
    """The top-k width of a step's entries of one kind: the largest ``k`` that its rows ask for."""
    return max((k for *_, k in items), default=0)


def _entry(target: int, values: list[float], at: int, k: int, width: int) -> Logprobs:
    """The dict of one position from its gathered row at ``values[at:]`` (``width`` top entries)."""
    entry = {target: values[at]}
    for j in range(k):
        entry.setdefault(int(values[at + 1 + j]), values[at + 1 + width + j])
    return entry

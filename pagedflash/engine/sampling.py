"""SamplingParams and the sampler, per request, in vLLM's order: ``logit_bias``, then the penalties
(repetition, then frequency and presence), then greedy argmax, or temperature, ``min_p``, top-k, top-p
and a draw.

A request with a ``seed`` draws from its own generator, so its tokens do not depend on what else is in
the batch; requests without one share the engine's generator. Logprobs (``logprobs``,
``prompt_logprobs``) are computed by :mod:`pagedflash.engine.logprobs` from the raw logits, before
any of these steps (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedflash.engine import layers

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy: dividing the logits by it would overflow fp32
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as OpenAI's API
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty| at most, as OpenAI's API


@dataclass
class SamplingParams:
    """How one request generates.

    max_tokens: generated tokens at most (>= 1). temperature: 0.0 is greedy (as is anything below
    ``MIN_TEMPERATURE``), else > 0. top_p in (0, 1]. top_k: 0 (off) or >= 1. seed: per-request
    generator seed (a 64-bit int). ignore_eos: keep going past EOS.
    stop_token_ids: extra ids that end the request (the stop token is kept in the output).
    presence_penalty / frequency_penalty in [-2, 2]: subtracted from the logit of every token generated
    so far, once / once per occurrence (OpenAI's). repetition_penalty > 0 (1: off): the logits of every
    token of the prompt and the output so far divided by it where positive, multiplied where not (the
    CTRL paper's, as transformers and vLLM). logit_bias: ``{token_id: bias}``, bias in [-100, 100], added
    to the raw logits. The three penalties and the bias apply to greedy requests too (their argmax
    is taken over the adjusted logits). min_p in [0, 1]: after temperature, tokens whose probability is
    below ``min_p`` times the top token's are dropped (0: off).
    logprobs: None (none), or ``k`` in ``[0, MAX_LOGPROBS]``: each generated token's log-probability,
    and those of the ``k`` most likely tokens at its position. prompt_logprobs: the same for each
    prompt token after the first. Both are the fp32 log-softmax of the logits the sampler saw,
    before temperature, top-k and top-p (as vLLM's default).
    Out-of-range values raise ``ValueError`` here, and are checked again per request in ``generate``.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | list[int] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self):
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """A message saying which field is out of range, or None."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            return f"max_tokens must be an int >= 1, got {self.max_tokens!r}"
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            return f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}"
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            return f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}"
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]):
            return f"seed must be a 64-bit int or None, got {self.seed!r}"
        if not isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            return f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}"
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            return f"stop_token_ids must be non-negative ints, got {list(self.stop_token_ids)!r}"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                return (f"{name} must be None or an int in [0, {MAX_LOGPROBS}] (0: the sampled or given token's "
                        f"only), got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                return f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is off), got {v!r}"
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < float("inf"):
            return f"repetition_penalty must be a finite number > 0 (1 is off), got {self.repetition_penalty!r}"
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be a number in [0, 1] (0 is off), got {self.min_p!r}"
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                return f"logit_bias must be a dict of token id to bias, got {type(self.logit_bias).__name__}"
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    return f"logit_bias keys must be non-negative int token ids, got {t!r}"
                if not _is_number(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                    return (f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                            f"got {b!r} for token {t}")
        return None

    @property
    def greedy(self) -> bool:
        """The token is the argmax (of the adjusted logits: see :attr:`adjusts_logits`)."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """A penalty reads the row's tokens so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """A bias or a penalty changes the logits before the pick (and so may change the argmax)."""
        return self.penalized or bool(self.logit_bias)

    @property
    def raw_greedy(self) -> bool:
        """The token is the argmax of the raw logits: the decode graph's own pick serves it."""
        return self.greedy and not self.adjusts_logits


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


class TokenHistory:
    """A row's tokens (prompt, then output) for its penalties, mirrored on the device: each call copies
    only the tokens appended to ``token_ids`` since the last (the list the engine appends to; capacity
    doubles), so the host's work a step does not grow with the row's length."""

    def __init__(self, token_ids: list[int], num_prompt: int):
        self.token_ids, self.num_prompt = token_ids, num_prompt
        self._ids: torch.Tensor | None = None
        self._count = 0  # tokens already on the device

    def device_ids(self, device) -> torch.Tensor:
        """int64 ``[len(token_ids)]`` on ``device``."""
        n = len(self.token_ids)
        if self._ids is None or self._ids.device != torch.device(device) or self._ids.shape[0] < n:
            grown = torch.empty(max(n, 64, 2 * (0 if self._ids is None else self._ids.shape[0])), dtype=torch.int64,
                                device=device)
            if self._ids is not None and self._ids.device == grown.device:
                grown[: self._count] = self._ids[: self._count]
            else:
                self._count = 0
            self._ids = grown
        if n > self._count:
            self._ids[self._count : n] = torch.tensor(self.token_ids[self._count : n], dtype=torch.int64)
            self._count = n
        return self._ids[:n]


def _adjust(logits: torch.Tensor, p: SamplingParams, history: TokenHistory | None) -> torch.Tensor:
    """``logits [V]`` (fp32) with ``p``'s bias and penalties; ``history``: the row's tokens so far (needed
    when ``p`` has penalties)."""
    device, vocab = logits.device, logits.shape[-1]
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
        logits = logits.index_add(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device))
    if not p.penalized:
        return logits
    if history is None:
        raise ValueError("sample: a row has penalties but no token history was given")
    ids = history.device_ids(device)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)
        scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        counts = torch.bincount(ids[history.num_prompt :], minlength=vocab)[:vocab].to(logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    """Mask ``logits [V]`` (already divided by temperature) below ``min_p`` of the top token's probability,
    then outside top-k, then outside the top-p nucleus."""
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None, greedy: torch.Tensor | None = None,
           history: list[TokenHistory | None] | None = None) -> torch.Tensor:
    """One token per row of ``logits [R, V]`` (the model's dtype; rows other than raw greedy ones are
    computed in fp32): int64 ``[R]`` on the logits' device. ``greedy``: the rows' argmax when the step
    already computed it (the decode graphs do). ``history``: per row, its tokens so far; needed by the
    rows whose params have penalties."""
    tokens = greedy if greedy is not None else layers.argmax(logits)
    rows = [i for i, p in enumerate(params) if not p.raw_greedy]
    if rows:
        tokens = tokens.clone()
    for i in rows:
        p = params[i]
        row = logits[i].float()
        if p.adjusts_logits:
            row = _adjust(row, p, None if history is None else history[i])
        if p.greedy:
            tokens[i] = layers.argmax(row[None])[0]
            continue
        probs = _filter(row / p.temperature, p.min_p, p.top_k, p.top_p).softmax(-1)
        gen = generators[i] if generators[i] is not None else default_generator
        tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens

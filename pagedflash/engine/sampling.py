"""SamplingParams and the sampler: greedy, or temperature then top-k then top-p, per request.

A request with a ``seed`` draws from its own generator, so its tokens do not depend on what else is in
the batch; requests without one share the engine's generator. Logprobs (``logprobs``,
``prompt_logprobs``) are computed by :mod:`pagedflash.engine.logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedflash.engine import layers

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy: dividing the logits by it would overflow fp32
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (vLLM's default max_logprobs)


@dataclass
class SamplingParams:
    """How one request generates.

    max_tokens: generated tokens at most (>= 1). temperature: 0.0 is greedy (as is anything below
    ``MIN_TEMPERATURE``), else > 0. top_p in (0, 1]. top_k: 0 (off) or >= 1. seed: per-request
    generator seed (a 64-bit int). ignore_eos: keep going past EOS.
    stop_token_ids: extra ids that end the request (the stop token is kept in the output).
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
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask ``logits [V]`` (already divided by temperature) outside top-k, then outside the top-p nucleus."""
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
           default_generator: torch.Generator | None, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits [R, V]`` (the model's dtype; sampled rows are computed in fp32):
    int64 ``[R]`` on the logits' device. ``greedy``: the rows' argmax when the step already computed
    it (the decode graphs do)."""
    tokens = greedy if greedy is not None else layers.argmax(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        tokens = tokens.clone()
    for i in rows:
        p = params[i]
        probs = _filter(logits[i].float() / p.temperature, p.top_k, p.top_p).softmax(-1)
        gen = generators[i] if generators[i] is not None else default_generator
        tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
    return tokens

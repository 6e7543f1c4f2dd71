"""SamplingParams and the sampler, per request, in vLLM's order: ``logit_bias``, then the penalties
(repetition, then frequency and presence), then greedy argmax, or temperature, ``min_p``, top-k, top-p
and a draw; the rows that need any of it are adjusted and drawn together, in a few batched ops.

A request with a ``seed`` draws from its own generator, so its tokens do not depend on what else is in
the batch; requests without one share the engine's generator. Logprobs (``logprobs``,
``prompt_logprobs``) are computed by :mod:`pagedflash.engine.logprobs` from the raw logits, before
any of these steps (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedflash.engine import layers
from pagedflash.engine.structured import Grammar, StructuredOutputsParams, mask_logits

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy: dividing the logits by it would overflow fp32
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as OpenAI's API
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty| at most, as OpenAI's API
MAX_REPETITION_PENALTY = 1e4  # finite in fp32, and so is a logit multiplied by it


@dataclass
class SamplingParams:
    """How one request generates.

    max_tokens: generated tokens at most (>= 1). temperature: 0.0 is greedy (as is anything below
    ``MIN_TEMPERATURE``), else > 0. top_p in (0, 1]. top_k: 0 (off) or >= 1. seed: per-request
    generator seed (a 64-bit int). ignore_eos: keep going past EOS.
    stop_token_ids: extra ids that end the request (the stop token is kept in the output).
    presence_penalty / frequency_penalty in [-2, 2]: subtracted from the logit of every token generated
    so far, once / once per occurrence (OpenAI's). repetition_penalty in (0, 1e4] (1: off): the logits of every
    token of the prompt and the output so far divided by it where positive, multiplied where not (the
    CTRL paper's, as transformers and vLLM). logit_bias: ``{token_id: bias}``, bias in [-100, 100], added
    to the raw logits. The three penalties and the bias apply to greedy requests too (their argmax
    is taken over the adjusted logits). min_p in [0, 1]: after temperature, tokens whose probability is
    below ``min_p`` times the top token's are dropped (0: off).
    structured_outputs: a :class:`~pagedflash.engine.structured.StructuredOutputsParams` (a JSON schema,
    any JSON object, a regex, choices or a grammar) the output must match; the tokens it forbids are
    masked before everything above, and the request stops when the grammar ends. Needs an engine with a
    tokenizer and the ``structured`` extra.
    logprobs: None (none), or ``k`` in ``[0, MAX_LOGPROBS]``: each generated token's log-probability,
    and those of the ``k`` most likely tokens at its position. prompt_logprobs: the same for each
    prompt token after the first. Both are the fp32 log-softmax of the raw logits, before the bias,
    the penalties, temperature, min_p, top-k and top-p (vLLM's default).
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
    structured_outputs: StructuredOutputsParams | None = None

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
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            return (f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 is off), "
                    f"got {self.repetition_penalty!r}")
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
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                return (f"structured_outputs must be a StructuredOutputsParams, got "
                        f"{type(self.structured_outputs).__name__}")
            return self.structured_outputs.problem()
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
        """A grammar, a bias or a penalty changes the logits before the pick (and so may change the argmax)."""
        return (self.structured_outputs is not None or self.penalized
                or any(self.logit_bias.values() if self.logit_bias else ()))

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
        if self._ids is None or self._ids.shape[0] < n:
            grown = torch.empty(max(n, 64, 2 * (0 if self._ids is None else self._ids.shape[0])), dtype=torch.int64,
                                device=device)
            if self._ids is not None:
                grown[: self._count] = self._ids[: self._count]
            self._ids = grown
        if n > self._count:
            self._ids[self._count : n] = to_device(self.token_ids[self._count : n], torch.int64, device)
            self._count = n
        return self._ids[:n]


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, through pinned memory to a GPU (a copy that does not wait
    for the device)."""
    cuda = torch.device(device).type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=True)


def _column(values: list[float], dtype: torch.dtype, device) -> float | torch.Tensor:
    """A per-row value: the number itself when every row has it (no copy), else a ``[R, 1]`` tensor."""
    if all(v == values[0] for v in values):
        return values[0]
    return to_device([[v] for v in values], dtype, device)


def _rows_of(rows: list[int], lengths: list[int], device) -> torch.Tensor:
    """Row ``rows[j]`` repeated ``lengths[j]`` times, on the device, without a sync."""
    return torch.repeat_interleave(to_device(rows, torch.int64, device), to_device(lengths, torch.int64, device),
                                   output_size=sum(lengths))


def _adjust(x: torch.Tensor, params: list[SamplingParams], history: list[TokenHistory | None] | None,
            grammars: list[Grammar | None] | None = None) -> torch.Tensor:
    """``x [R, V]`` (fp32 logits) with each row's grammar mask, bias, then penalties (a few batched ops
    whatever ``R``); ``history[j]``: row ``j``'s tokens so far (needed where its params have penalties);
    ``grammars[j]``: row ``j``'s matcher (needed where its params have ``structured_outputs``)."""
    device = x.device
    constrained = [j for j, p in enumerate(params) if p.structured_outputs is not None]
    if constrained:
        if grammars is None or any(grammars[j] is None for j in constrained):
            raise ValueError("sample: a row has structured_outputs but no grammar was given")
        x = mask_logits(x, grammars)
    bias = [(j, t, b) for j, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items() if b]
    if bias:
        where = to_device([[j for j, _, _ in bias], [t for _, t, _ in bias]], torch.int64, device)
        x = x.index_put((where[0], where[1]), to_device([b for _, _, b in bias], x.dtype, device), accumulate=True)
    penalized = [j for j, p in enumerate(params) if p.penalized]
    if not penalized:
        return x
    if history is None or any(history[j] is None for j in penalized):
        raise ValueError("sample: a row has penalties but no token history was given")
    ids = {j: history[j].device_ids(device) for j in penalized}
    repeated = [j for j in penalized if params[j].repetition_penalty != 1.0]
    if repeated:
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen.index_put_((_rows_of(repeated, [len(ids[j]) for j in repeated], device), torch.cat([ids[j] for j in repeated])),
                        torch.ones((), dtype=torch.bool, device=device))  # a host True would be copied with a sync
        penalty = to_device([[p.repetition_penalty] for p in params], x.dtype, device)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    counted = [j for j in penalized if params[j].frequency_penalty != 0.0 or params[j].presence_penalty != 0.0]
    if counted:
        out = [ids[j][history[j].num_prompt :] for j in counted]
        lengths = [len(t) for t in out]
        counts = torch.zeros_like(x).index_put_((_rows_of(counted, lengths, device), torch.cat(out)),
                                                torch.ones(sum(lengths), dtype=x.dtype, device=device), accumulate=True)
        weights = to_device([[p.frequency_penalty, p.presence_penalty] for p in params], x.dtype, device)
        x = x - weights[:, :1] * counts - weights[:, 1:] * (counts > 0).to(x.dtype)
    return x


def _probabilities(y: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of ``y [R, V]`` (logits over temperature) draws from, in the
    vocabulary's order: ``min_p``, then top-k (the ties of its k-th value kept), then top-p (the
    smallest prefix of the sorted tokens reaching ``top_p``). A row's depends on that row alone: the
    filters' masks are found on the sorted rows and put back in the vocabulary's order, and a row
    without a filter is masked nowhere, whatever its neighbours ask."""
    vocab, device = y.shape[-1], y.device
    if not any(p.min_p > 0.0 or 0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        return y.softmax(-1)
    s, order = y.sort(dim=-1, descending=True, stable=True)
    if any(p.min_p > 0.0 for p in params):
        probs = s.softmax(-1)
        s = s.masked_fill(probs < _column([p.min_p for p in params], s.dtype, device) * probs[:, :1], float("-inf"))
    if any(0 < p.top_k < vocab for p in params):
        k = _column([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, device)
        s = s.masked_fill(s < (s[:, k - 1 : k] if isinstance(k, int) else s.gather(1, k - 1)), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        probs = s.softmax(-1)
        # top_p = 1 is off (inf): a cumulative sum can reach 1.0 before its last term
        top_p = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], s.dtype, device)
        s = s.masked_fill(_row_cumsum(probs) - probs >= top_p, float("-inf"))
    dropped = torch.empty_like(s, dtype=torch.bool).scatter_(1, order, s == float("-inf"))
    return y.masked_fill(dropped, float("-inf")).softmax(-1)


def _row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(-1)`` by one algorithm whatever the number of rows (CUDA scans a lone row with
    another, whose sums round differently): a lone row is scanned beside a copy of itself."""
    return x.cumsum(-1) if x.shape[0] != 1 else x.expand(2, -1).contiguous().cumsum(-1)[:1]


def _pick(x: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
          default_generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of the adjusted logits ``x [R, V]``: greedy rows' argmax; the others drawn
    after temperature and the filters, as ``argmax(probs / q)`` with ``q ~ Exp(1)`` (a draw from
    ``probs``): ``q`` of a row with a generator comes from that generator alone, the rest from
    ``default_generator`` in one call."""
    drawn = [j for j, p in enumerate(params) if not p.greedy]
    if len(drawn) < len(params):
        picks = layers.argmax(x)
        if not drawn:
            return picks
    device, ps = x.device, [params[j] for j in drawn]
    where = None if len(drawn) == len(params) else to_device(drawn, torch.int64, device)
    y = x if where is None else x.index_select(0, where)
    # times 1/T: a GPU divides by a number as a product with its reciprocal, by a tensor not; a product
    # rounds alike either way, so a row's bits do not follow whether its neighbours share its temperature
    y = y * _column([1.0 / p.temperature for p in ps], y.dtype, device)
    if any(p.adjusts_logits for p in ps):
        y = y.clamp(_FLT_MIN, _FLT_MAX)
    probs = _probabilities(y, ps)
    q = torch.empty_like(probs)
    if any(generators[j] is None for j in drawn):
        q.exponential_(generator=default_generator)
    for row, j in enumerate(drawn):
        if generators[j] is not None:
            q[row].exponential_(generator=generators[j])
    choice = (probs / q.clamp_min_(_TINY)).argmax(-1)  # q > 0: a token of probability 0 never wins
    return picks.index_copy_(0, where, choice) if where is not None else choice


_FLT_MAX = torch.finfo(torch.float32).max
_FLT_MIN = -_FLT_MAX  # a huge penalty's inf clamped: softmax never subtracts inf from inf
_TINY = torch.finfo(torch.float32).tiny
MAX_SAMPLE_ROWS = 64  # rows adjusted and drawn together: bounds the [rows, V] temporaries (fp32 logits and
# probabilities, a sort's values and int64 order, masks: ~32 bytes a logit at most, ~320 MB at a 152K
# vocabulary; the engine's activation profile samples with every filter and penalty on)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None, greedy: torch.Tensor | None = None,
           history: list[TokenHistory | None] | None = None,
           grammars: list[Grammar | None] | None = None) -> torch.Tensor:
    """One token per row of ``logits [R, V]`` (the model's dtype; rows other than raw greedy ones are
    computed in fp32, ``MAX_SAMPLE_ROWS`` at a time in a few batched ops): int64 ``[R]`` on the logits'
    device. ``greedy``: the rows' argmax when the step already computed it (the decode graphs do).
    ``history``: per row, its tokens so far; needed by the rows whose params have penalties.
    ``grammars``: per row, its matcher; needed by the rows whose params have ``structured_outputs``. No
    device sync: the small per-step tables go through pinned memory."""
    rows = [i for i, p in enumerate(params) if not p.raw_greedy]
    if rows and len(rows) == len(params) <= MAX_SAMPLE_ROWS:  # every row, one chunk: no gather, no scatter
        return _pick(_adjust(logits.float(), params, history, grammars), params, generators, default_generator)
    tokens = greedy if greedy is not None else layers.argmax(logits)
    if not rows:
        return tokens
    tokens = tokens.clone()
    for start in range(0, len(rows), MAX_SAMPLE_ROWS):
        chunk = rows[start : start + MAX_SAMPLE_ROWS]
        where = to_device(chunk, torch.int64, logits.device)
        x = _adjust(logits.index_select(0, where).float(), [params[i] for i in chunk],
                    None if history is None else [history[i] for i in chunk],
                    None if grammars is None else [grammars[i] for i in chunk])
        tokens.index_copy_(0, where, _pick(x, [params[i] for i in chunk], [generators[i] for i in chunk],
                                           default_generator))
    return tokens

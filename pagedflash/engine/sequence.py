"""One request's state inside the engine, and what ``step`` and ``generate`` hand back for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from pagedflash.engine.sampling import SamplingParams, TokenHistory


class Status(enum.Enum):
    WAITING = "waiting"  # not holding blocks (new, or preempted for recompute)
    RUNNING = "running"  # holds blocks; prefilling (possibly in chunks) or decoding
    FINISHED = "finished"


class RequestOutput:
    """What one :meth:`LLM.step <pagedflash.engine.LLM.step>` produced for one request.

    request_id: as returned by ``add_request``. new_token_ids: the tokens generated in this step
    (concatenated over the steps they are the whole output). token_ids: every token generated up to
    this step (no prompt). finished: whether the request ended in this step; then finish_reason is
    ``"stop"`` (EOS or a stop id, which is kept) or ``"length"`` (max_tokens or the model's
    maximum length). num_cached_tokens: prompt tokens served from the prefix cache at admission.
    new_logprobs: with ``SamplingParams.logprobs``, one ``{token_id: logprob}`` per token of
    ``new_token_ids`` (see :class:`GenerationOutput`), else None; ``logprobs``: those of every token
    up to this step. prompt_logprobs: with ``SamplingParams.prompt_logprobs``, the prompt's entries
    in the request's first output (None in later ones).

    ``token_ids``, ``prompt_token_ids`` and ``logprobs`` are sliced from the request's lists when
    read, so that a step costs the host nothing per token of context.
    """

    __slots__ = ("request_id", "new_token_ids", "finished", "finish_reason", "num_cached_tokens", "new_logprobs",
                 "prompt_logprobs", "_tokens", "_num_prompt", "_end", "_logprobs")

    def __init__(self, request_id: int, new_token_ids: list[int], finished: bool, finish_reason: str | None,
                 num_cached_tokens: int, tokens: list[int], num_prompt_tokens: int, *,
                 logprobs: list[dict[int, float]] | None = None,
                 prompt_logprobs: list[dict[int, float] | None] | None = None):
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_cached_tokens = num_cached_tokens
        self._tokens, self._num_prompt, self._end = tokens, num_prompt_tokens, len(tokens)
        self._logprobs = logprobs
        end = self._end - num_prompt_tokens
        self.new_logprobs = None if logprobs is None else logprobs[end - len(new_token_ids) : end]
        self.prompt_logprobs = prompt_logprobs

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._tokens[: self._num_prompt]

    @property
    def token_ids(self) -> list[int]:
        return self._tokens[self._num_prompt : self._end]

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return None if self._logprobs is None else self._logprobs[: self._end - self._num_prompt]

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, new_token_ids={self.new_token_ids}, "
                f"num_tokens={self._end - self._num_prompt}, finished={self.finished}, "
                f"finish_reason={self.finish_reason!r})")


@dataclass
class GenerationOutput:
    """The result of one prompt.

    token_ids: generated ids only (no prompt). text (with a tokenizer): their text, the EOS or stop id
    that ended the request left out (as vLLM's). finish_reason: ``"stop"`` (EOS or a stop id, which is
    kept in token_ids), ``"length"`` (max_tokens or the model's maximum length) or ``"error"`` (then
    ``error`` says why and nothing was generated). ttft: seconds from the ``generate`` call to the
    first token. itl: seconds between consecutive tokens (``len(token_ids) - 1`` entries). num_cached_tokens: prompt
    tokens served from the prefix cache at first admission (0 with ``prompt_logprobs``, whose
    prompt is computed whole).

    logprobs (with ``SamplingParams.logprobs=k``, else None): one dict ``{token_id: logprob}`` per
    generated token, holding that token and the ``k`` most likely ones at its position (``k`` or
    ``k + 1`` entries; the generated token first). prompt_logprobs (with ``prompt_logprobs=k``):
    the same for each prompt token, None for the first one. Values are the fp32 log-softmax of the
    model's raw logits, before the bias, the penalties, temperature, min_p, top-k and top-p.
    """

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def token_latencies(self) -> list[float]:
        """Per-token latencies: the TTFT, then each inter-token gap."""
        return ([self.ttft] if self.ttft is not None else []) + self.itl


class Sequence:
    """Token ids (prompt + generated) and how far the KV cache has caught up with them.

    ``num_computed`` tokens have their K/V in the cache; the next step feeds tokens from there on. When
    it reaches ``len(token_ids)`` the step samples a new token. Decoding is the case of one token left.
    """

    def __init__(self, seq_id: int, prompt: list[int], params: SamplingParams, arrival: float, device):
        self.seq_id = seq_id
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        self.num_cached_tokens: int | None = None  # at first admission
        self.num_preemptions = 0
        self.arrival = arrival
        self.token_times: list[float] = []
        self.finish_reason: str | None = None
        self.num_reported = 0  # generated tokens already handed out by a step's RequestOutput
        self.num_prefix_hit = 0  # leading tokens whose pages came from the prefix cache at the latest admission
        # logprobs: one entry per generated token; prompt_logprobs: one per prompt token covered so far
        self.logprobs = [] if params.logprobs is not None else None
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.asks_logprobs = params.logprobs is not None or params.prompt_logprobs is not None  # entries missing
        self.history = TokenHistory(self.token_ids, self.num_prompt_tokens) if params.penalized else None
        self.grammar = None  # a Grammar (pagedflash.engine.structured) where params.structured_outputs is set
        self.generator = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator(device=device).manual_seed(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def step_output(self) -> RequestOutput:
        """The tokens generated since the last call, with the request's state now."""
        new = self.token_ids[self.num_prompt_tokens + self.num_reported :]
        first = self.num_reported == 0
        self.num_reported += len(new)
        return RequestOutput(self.seq_id, new, self.status is Status.FINISHED, self.finish_reason,
                             self.num_cached_tokens or 0, self.token_ids, self.num_prompt_tokens,
                             logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs if first else None)

    def to_output(self, index: int) -> GenerationOutput:
        times = self.token_times
        return GenerationOutput(
            index=index,
            prompt_token_ids=self.token_ids[: self.num_prompt_tokens],
            token_ids=self.output_ids,
            finish_reason=self.finish_reason,
            ttft=times[0] - self.arrival if times else None,
            itl=[b - a for a, b in zip(times, times[1:])],
            latency=times[-1] - self.arrival if times else None,
            num_cached_tokens=self.num_cached_tokens or 0,
            num_preemptions=self.num_preemptions,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )

"""The HTTP load generator behind ``pagedflash bench online``: workloads, arrivals, the streaming
client and the metrics, against any OpenAI-compatible server (no engine or torch import here).

Workloads (:class:`Request` lists, seeded; ``seed`` draws the lengths, ``content_seed`` the tokens,
so a sweep can send the same lengths with new tokens at every point and a prefix cache never hits
across points):

- :func:`random_requests`: prompt and output lengths uniform in ranges; prompts are token-id lists,
  so their lengths are exact, sent with ``ignore_eos`` so every request generates ``max_tokens``.
- :func:`shared_prefix_requests`: ``groups`` system prompts of ``system_len`` tokens; request ``i``
  is group ``i % groups``'s system prompt followed by its own suffix.
- :func:`sharegpt_requests`: a ShareGPT-format JSON file (a list of ``{"conversations": [{"from":
  "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``): the first turn (human) is the
  prompt; the length of the second (gpt) is ``max_tokens``. With a tokenizer both lengths are token
  counts and the prompt is sent as token ids; without one the lengths are whitespace-separated
  words and the prompt is sent as text (its ``prompt_len`` is then an estimate; the server's
  ``usage`` gives the real count).

Arrivals (:func:`arrival_offsets`): Poisson at a rate (exponential gaps from ``random.Random(seed)``,
the first request at 0), or all at once for ``inf``; :func:`run_load` can also cap the requests in
flight (``max_concurrency``). A request's clock starts when it is sent, after any wait for a
concurrency slot.

Per request (:class:`RequestResult`), from the SSE stream of ``POST /v1/completions`` (read as raw
bytes through :func:`~pagedflash.bench.loadgen_http.connection_pool`, the events split here) with
``stream_options.include_usage``, each chunk timed when its bytes are read (chunks that arrive in
one read share its time): TTFT (send to the first chunk that carries a token), the gaps between
chunks (ITL; a chunk carrying ``k`` tokens counts as ``k`` gaps of ``gap / k``, as SGLang's
bench_serving counts them; tokens in a chunk are read from a per-chunk ``usage``, ``token_ids`` or
``logprobs.tokens`` when the server sends one of them, else one per chunk with text or without a
``finish_reason``), end-to-end latency, and the token counts from the final ``usage`` (the chunk
count when a server sends none). TPOT = (e2e - TTFT) / (output tokens - 1). A request fails on a
non-200 status, an ``error`` event, a stream that ends before ``data: [DONE]``, a connection error
or ``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedflash.bench.loadgen_http import connection_pool

METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names (ms in reports and SLOs)
PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------- workloads


@dataclass
class Request:
    """One request of a workload: ``prompt`` token ids (or text), its length, ``max_tokens``."""

    prompt: list[int] | str
    prompt_len: int
    max_tokens: int


class TokenSpace:
    """Token ids a random prompt may hold: ``[0, vocab_size)`` less ``excluded`` (special tokens)."""

    def __init__(self, vocab_size: int, excluded: Sequence[int] = (0, 1, 2)):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        skip = set(excluded)
        self.ids = [i for i in range(vocab_size) if i not in skip]
        if not self.ids:
            raise ValueError(f"vocab_size {vocab_size} leaves no ids once {sorted(skip)[:8]} are excluded")

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.ids, k=n)


def _check_range(name: str, lo_hi: tuple[int, int], low: int = 1) -> tuple[int, int]:
    lo, hi = lo_hi
    if not (isinstance(lo, int) and isinstance(hi, int) and low <= lo <= hi):
        raise ValueError(f"{name} must be a range {low} <= lo <= hi, got {lo_hi!r}")
    return lo, hi


def _check_count(name: str, n: int, low: int = 1) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < low:
        raise ValueError(f"{name} must be an int >= {low}, got {n!r}")
    return n


def random_requests(n: int, *, input_len: tuple[int, int], output_len: tuple[int, int], tokens: TokenSpace,
                    seed: int = 0, content_seed: int | None = None) -> list[Request]:
    """``n`` requests, prompt and output lengths uniform in ``input_len`` / ``output_len`` (inclusive)."""
    _check_count("num_prompts", n)
    ilo, ihi = _check_range("input_len", input_len)
    olo, ohi = _check_range("output_len", output_len)
    lengths, content = random.Random(seed), random.Random(seed if content_seed is None else content_seed)
    shapes = [(lengths.randint(ilo, ihi), lengths.randint(olo, ohi)) for _ in range(n)]
    return [Request(tokens.sample(content, p), p, m) for p, m in shapes]


def shared_prefix_requests(n: int, *, groups: int, system_len: int, suffix_len: tuple[int, int],
                           output_len: tuple[int, int], tokens: TokenSpace, seed: int = 0,
                           content_seed: int | None = None) -> list[Request]:
    """``n`` requests in ``groups`` groups; request ``i`` = system prompt ``i % groups`` (``system_len``
    tokens) + its own suffix (length uniform in ``suffix_len``)."""
    _check_count("num_prompts", n)
    _check_count("prefix_groups", groups)
    _check_count("prefix_len", system_len)
    slo, shi = _check_range("suffix_len", suffix_len)
    olo, ohi = _check_range("output_len", output_len)
    lengths, content = random.Random(seed), random.Random(seed if content_seed is None else content_seed)
    systems = [tokens.sample(content, system_len) for _ in range(groups)]
    shapes = [(lengths.randint(slo, shi), lengths.randint(olo, ohi)) for _ in range(n)]
    out = []
    for i, (s, m) in enumerate(shapes):
        prompt = systems[i % groups] + tokens.sample(content, s)
        out.append(Request(prompt, len(prompt), m))
    return out


def _turns(entry) -> list[tuple[str, str]]:
    turns = entry.get("conversations", entry.get("messages")) if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return []
    out = []
    for t in turns:
        if isinstance(t, dict):
            who, text = t.get("from", t.get("role")), t.get("value", t.get("content"))
            if isinstance(who, str) and isinstance(text, str):
                out.append((who, text))
    return out


def sharegpt_requests(path, n: int, *, tokenizer=None, seed: int = 0, max_len: int = 2048) -> list[Request]:
    """``n`` requests from a ShareGPT-format JSON file (module docstring), shuffled with ``seed``.
    Conversations whose first two turns are not human then gpt, with an empty side, or longer than
    ``max_len`` (prompt + output) are skipped. ``tokenizer``: anything with ``encode(text) -> ids``."""
    _check_count("num_prompts", n)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"dataset path {str(path)!r}: cannot read a ShareGPT JSON file ({e})") from e
    if not isinstance(data, list):
        raise ValueError(f"dataset path {str(path)!r}: expected a JSON list of conversations, got "
                         f"{type(data).__name__}")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        turns = _turns(data[i])
        if len(turns) < 2 or turns[0][0] not in ("human", "user") or turns[1][0] not in ("gpt", "assistant"):
            continue
        prompt_text, answer = turns[0][1], turns[1][1]
        if tokenizer is not None:
            prompt, out_len = tokenizer.encode(prompt_text), len(tokenizer.encode(answer))
            prompt_len = len(prompt)
        else:
            prompt, prompt_len, out_len = prompt_text, len(prompt_text.split()), len(answer.split())
        if prompt_len < 1 or out_len < 1 or prompt_len + out_len > max_len:
            continue
        out.append(Request(prompt, prompt_len, out_len))
        if len(out) == n:
            return out
    raise ValueError(f"dataset path {str(path)!r}: {n} prompts asked, only {len(out)} of its {len(data)} entries "
                     f"are usable (human then gpt turn, both non-empty, prompt + output <= {max_len})")


# ---------------------------------------------------------------- arrivals


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``n`` requests is sent: a Poisson process at ``rate``
    requests/s (exponential gaps, the first at 0), or all at 0 when ``rate`` is ``inf``."""
    if not (isinstance(rate, (int, float)) and rate > 0):
        raise ValueError(f"request_rate must be > 0 (or inf), got {rate!r}")
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------- the client


@dataclass
class RequestResult:
    """One request as the client saw it (seconds). ``itl`` has one entry per token after the first
    chunk's; ``start``: when it was sent, from the start of the run."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    chunks: int = 0
    expected_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None for fewer than two tokens."""
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _chunk_tokens(data: dict, choice: dict, used: int) -> int:
    """Tokens carried by one streamed chunk (module docstring)."""
    usage = data.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"] - used
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return 1 if choice.get("text") or not choice.get("finish_reason") else 0


def _error_text(body: bytes | str) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        doc = json.loads(text)
        err = doc.get("error", doc) if isinstance(doc, dict) else doc
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:300]
    except ValueError:
        return text[:300]


def _on_data(result: RequestResult, body: bytes, now: float, t0: float, clock: list[float]) -> bool:
    """One ``data:`` payload received at ``now``; ``clock`` = [time of the last token chunk, tokens
    so far]. Returns True when the stream is over ([DONE] or an error event)."""
    if body == b"[DONE]":
        result.ok = True
        return True
    data = json.loads(body)
    if data.get("error"):
        result.error = f"error event: {_error_text(body)}"
        return True
    choices = data.get("choices") or []
    if choices:
        k = _chunk_tokens(data, choices[0], int(clock[1]))
        if k > 0:
            if result.chunks == 0:
                result.ttft = now - t0
            else:
                result.itl.extend([(now - clock[0]) / k] * k)
            result.chunks += 1
            clock[0], clock[1] = now, clock[1] + k
    usage = data.get("usage")
    if isinstance(usage, dict):  # the final chunk's (or each chunk's) running totals
        result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
        result.output_tokens = usage.get("completion_tokens") or result.output_tokens
    return False


async def _stream(pool, url: str, payload: dict, headers: dict, result: RequestResult, t0: float) -> None:
    """Events are timed when their bytes arrive: lines that came in one read share its time."""
    hdrs = [(b"Content-Type", b"application/json"), *((k.encode(), v.encode()) for k, v in headers.items())]
    async with pool.stream("POST", url, headers=hdrs, content=json.dumps(payload).encode()) as resp:
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {_error_text(await resp.aread())}"
            return
        clock, pending, over = [t0, 0], b"", False
        async for piece in resp.aiter_stream():
            now = time.perf_counter()
            lines = (pending + piece).split(b"\n")
            pending = lines.pop()
            for line in lines:
                line = line.strip()
                if line.startswith(b"data:") and _on_data(result, line[5:].strip(), now, t0, clock):
                    over = True
                    break
            if over:
                break
        result.e2el = time.perf_counter() - t0
        if not over:
            result.error = "the stream ended before data: [DONE]"
        elif result.ok and result.chunks == 0:
            result.ok, result.error = False, "no token was streamed"
        elif result.ok and not result.output_tokens:
            result.output_tokens = int(clock[1])


async def send_request(pool, url: str, payload: dict, headers: dict, *, timeout: float,
                       prompt_len: int, run_start: float) -> RequestResult:
    """Send one streaming completion and time it; never raises (failures are in the result)."""
    result = RequestResult(prompt_tokens=prompt_len, expected_tokens=payload.get("max_tokens", 0))
    t0 = time.perf_counter()
    result.start = t0 - run_start
    try:
        await asyncio.wait_for(_stream(pool, url, payload, headers, result, t0), timeout)
    except asyncio.TimeoutError:
        result.ok, result.error = False, f"timed out after {timeout:g} s"
    except Exception as e:  # noqa: BLE001  (a connection error or a malformed chunk fails this request only)
        result.ok, result.error = False, f"{type(e).__name__}: {e}"[:300]
    if not result.ok:
        result.e2el = time.perf_counter() - t0
    return result


def completion_payload(req: Request, *, model: str, ignore_eos: bool, temperature: float = 0.0,
                       extra: dict | None = None) -> dict:
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": temperature,
               "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True
    return {**payload, **(extra or {})}


async def run_load(requests: Sequence[Request], *, base_url: str, model: str, rate: float = math.inf,
                   max_concurrency: int | None = None, seed: int = 0, timeout: float = 600.0,
                   api_key: str | None = None, ignore_eos: bool = True, temperature: float = 0.0,
                   extra_body: dict | None = None, offsets: Sequence[float] | None = None,
                   start_at=None) -> tuple[list[RequestResult], float]:
    """Send ``requests`` at Poisson ``rate`` (``inf``: all at once), at most ``max_concurrency`` in
    flight. Returns the results in request order and the run's duration (the start to the last
    completion), in seconds. Every request ends within ``timeout`` seconds of being sent.
    ``offsets`` (seconds after the start, one per request) replaces the draw from ``rate`` and
    ``seed``; ``start_at``, called once the client is built, returns the start as a
    ``time.monotonic()`` value (client processes share one; default: now)."""
    if max_concurrency is not None:
        _check_count("max_concurrency", max_concurrency)
    offsets = arrival_offsets(len(requests), rate, seed) if offsets is None else list(offsets)
    if len(offsets) != len(requests):
        raise ValueError(f"offsets: one per request expected, got {len(offsets)} for {len(requests)} requests")
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with connection_pool(base_url, connections=max_concurrency or len(requests)) as pool:
        if start_at is None:
            start = time.perf_counter()
        else:
            at = start_at()
            start = time.perf_counter() + (at - time.monotonic())

        async def one(req: Request, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            payload = completion_payload(req, model=model, ignore_eos=ignore_eos, temperature=temperature,
                                         extra=extra_body)
            if slots is None:
                return await send_request(pool, url, payload, headers, timeout=timeout,
                                          prompt_len=req.prompt_len, run_start=start)
            async with slots:
                return await send_request(pool, url, payload, headers, timeout=timeout,
                                          prompt_len=req.prompt_len, run_start=start)

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        duration = time.perf_counter() - start
    return list(results), duration


# ---------------------------------------------------------------- metrics


def percentile(xs: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile with linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms; keys ttft, tpot, e2el)."""
    slo = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput: expected NAME:MS with NAME one of ttft, tpot, e2el, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput: {name} needs a positive number of milliseconds, got {item!r}")
        slo[name] = ms
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """A successful request whose TTFT, TPOT and e2e latency are within the SLO's (ms); a request of
    one token has no TPOT and meets any TPOT bound."""
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
    return r.ok and all(1e3 * got[k] <= v for k, v in slo.items())


def summarize(results: Sequence[RequestResult], duration: float, slo: dict[str, float] | None = None) -> dict:
    """Throughputs and latency statistics (ms: ``<metric>_<mean|p50|p90|p99>_ms``) of one run."""
    ok = [r for r in results if r.ok]
    samples = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
               "itl": [x for r in ok for x in r.itl], "e2el": [r.e2el for r in ok]}
    inp, outp = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "input_tokens": inp, "output_tokens": outp,
         "short_outputs": sum(r.output_tokens < r.expected_tokens for r in ok),
         "request_throughput": per_s(len(ok)), "input_throughput": per_s(inp), "output_throughput": per_s(outp),
         "total_token_throughput": per_s(inp + outp)}
    for name in METRICS:
        xs = samples[name]
        s[f"{name}_mean_ms"] = 1e3 * sum(xs) / len(xs) if xs else None
        for p in PERCENTILES:
            v = percentile(xs, p)
            s[f"{name}_p{p}_ms"] = None if v is None else 1e3 * v
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        s["good_requests"], s["goodput"] = good, per_s(good)
    errors = [r.error for r in results if not r.ok]
    if errors:
        s["first_error"] = errors[0]
    return s

"""Structured outputs: a request's tokens constrained to a JSON schema, any JSON object, a regular
expression, a list of choices or an EBNF grammar (vLLM's ``StructuredOutputsParams``), through
xgrammar (the ``structured`` extra).

The engine compiles a request's grammar when the request is added (a bad schema is a ``ValueError``
then) and keeps a matcher on its sequence. Each step, before the pick, the sampler masks the logits of
the tokens the matcher forbids (:func:`mask_logits`); the step's commit feeds the matcher the sampled
token (:meth:`Grammar.accept`), and a request whose grammar has ended (its stop token accepted)
finishes with ``"stop"``. A constrained row is sampled on the host's schedule: it leaves the decode
graph's own pick and run-ahead, as rows with a bias or a penalty do. Logprobs stay those of the raw
logits.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from dataclasses import dataclass

import torch

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Bounds on what a request may ask to compile: a grammar compiles on one thread (one of the server's
# grammar threads, else the caller of add_request or generate), which it holds until done, and a schema
# nested hundreds deep takes seconds to minutes (64 deep: ~15 ms on a 512-token vocabulary)
MAX_SPEC_CHARS = 65536  # a schema's JSON text, a regex, a grammar, all choices together
MAX_SCHEMA_DEPTH = 64  # nesting of a schema's objects and arrays
MAX_CHOICES = 1024
MAX_KNOWN_GRAMMARS = 4096  # grammars a compiler remembers compiling (GrammarCompiler.compiled_before)
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match; exactly one of:

    json: a JSON schema (a dict, or its JSON text). json_object: True for any JSON object.
    regex: a regular expression the whole output matches. choice: a list of strings, the output one
    of them. grammar: an EBNF grammar (xgrammar's / GBNF syntax, rule ``root`` first).
    disable_any_whitespace: JSON without whitespace between tokens (default: any whitespace, as vLLM).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def problem(self) -> str | None:
        """A message naming the field that is wrong, or None."""
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            return (f"structured_outputs: exactly one of {', '.join(_KINDS)} must be set, got "
                    f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            problem = _schema_problem(self.json)
            if problem:
                return f"structured_outputs.json {problem}"
        if not isinstance(self.json_object, bool):
            return f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or len(v) > MAX_SPEC_CHARS):
                return (f"structured_outputs.{name} must be a non-empty string of at most {MAX_SPEC_CHARS} "
                        f"characters, got {_short(v)}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)
                                        or len(self.choice) > MAX_CHOICES
                                        or sum(map(len, self.choice)) > MAX_SPEC_CHARS):
            return (f"structured_outputs.choice must be a non-empty list of at most {MAX_CHOICES} strings of "
                    f"{MAX_SPEC_CHARS} characters in all, got {_short(self.choice)}")
        if not isinstance(self.disable_any_whitespace, bool):
            return f"structured_outputs.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}"
        return None



def _schema_problem(schema) -> str | None:
    """Why ``schema`` (a dict or JSON text) cannot be compiled, as the end of a sentence, or None."""
    if not isinstance(schema, (dict, str)):
        return f"must be a JSON schema (a dict or a string), got {type(schema).__name__}"
    try:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        value = json.loads(text)
    except (TypeError, ValueError) as e:
        return f"is not JSON: {e}"
    if len(text) > MAX_SPEC_CHARS:
        return f"has {len(text)} characters of JSON; at most {MAX_SPEC_CHARS}"
    if _depth(value) > MAX_SCHEMA_DEPTH:
        return f"nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep"
    return None


def _key(params: StructuredOutputsParams) -> tuple:
    """What a compiled grammar depends on, hashable."""
    spec = getattr(params, params.kind)
    if isinstance(spec, dict):
        spec = json.dumps(spec)
    elif isinstance(spec, list):
        spec = tuple(spec)
    return params.kind, spec, params.disable_any_whitespace


def _depth(value) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return 1 + max(map(_depth, children), default=0) if isinstance(value, (dict, list)) else 0


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured_outputs needs xgrammar: pip install 'pagedflash[structured]'") from None
    return xgrammar


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` against one vocabulary (the tokenizer's, padded to
    the model's ``vocab_size``; ``stop_ids``: the tokens that end a finished grammar, the engine's
    EOS ids). Built on the first structured request; xgrammar caches what it compiled, up to
    ``cache_bytes``."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], cache_bytes: int = 256 << 20):
        xgr = _xgrammar()
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

        if not stop_ids:
            raise ValueError("structured_outputs needs the model's EOS token id to end a grammar, and its config "
                             "has none (eos_token_id)")
        tok = getattr(tokenizer, "tok", tokenizer)  # the engine's wrapper of a tokenizers.Tokenizer
        if not isinstance(tok, PreTrainedTokenizerBase):
            tok = PreTrainedTokenizerFast(tokenizer_object=tok)
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=4, cache_limit_bytes=cache_bytes)
        self._compiled: collections.OrderedDict = collections.OrderedDict()  # keys of the last grammars compiled
        self._compiled_lock = threading.Lock()
        self.batch = xgr.BatchGrammarMatcher()  # fills the rows' masks on half the host's cores
        stop = torch.tensor(self.stop_ids)
        self.stop_mask = torch.zeros(-(-vocab_size // 32), dtype=torch.int32)  # a row allowing the stop tokens only
        self.stop_mask.index_put_((stop // 32,), torch.ones_like(stop, dtype=torch.int32) << (stop % 32).int(),
                                  accumulate=True)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (a cache hit after the first time); ``ValueError`` naming the field when
        xgrammar refuses it."""
        kind = params.kind
        try:
            compiled = self._compile(params, kind)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[-1]) if str(e).strip() else type(e).__name__
            raise ValueError(f"structured_outputs.{kind}: xgrammar cannot compile it: {reason}") from None
        key = _key(params)
        with self._compiled_lock:
            self._compiled[key] = None
            self._compiled.move_to_end(key)
            while len(self._compiled) > MAX_KNOWN_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def compiled_before(self, params: StructuredOutputsParams) -> bool:
        """Whether one of the last :data:`MAX_KNOWN_GRAMMARS` grammars compiled was this one (then likely
        a hit of xgrammar's cache, unless it was evicted there)."""
        with self._compiled_lock:
            return _key(params) in self._compiled

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile ``params``; ``ValueError`` naming the field when that fails or when no token of the
        vocabulary can begin an output the grammar allows."""
        bitmask = torch.zeros(1, -(-self.vocab_size // 32), dtype=torch.int32)
        self.xgr.GrammarMatcher(self.compile(params)).fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise ValueError(f"structured_outputs.{params.kind}: no token of the vocabulary can begin an output "
                             "it allows")

    def _compile(self, params: StructuredOutputsParams, kind: str):
        c = self._compiler
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return c.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":  # each choice a JSON-escaped EBNF literal
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in params.choice))
        return c.compile_grammar(params.grammar)

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        return Grammar(self.xgr.GrammarMatcher(self.compile(params)), self)


class Grammar:
    """One request's matcher: the tokens it allows next, fed the tokens the request generates."""

    def __init__(self, matcher, compiler: GrammarCompiler):
        self.matcher, self.compiler = matcher, compiler

    def accept(self, token: int) -> bool:
        """Feed the sampled token; False if the grammar refuses it (a stop token where the grammar had
        reached a state no token of the vocabulary continues: :func:`fill_bitmask`)."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar has ended: its stop token was accepted."""
        return self.matcher.is_terminated()


def mask_logits(x: torch.Tensor, grammars: list[Grammar | None]) -> torch.Tensor:
    """A copy of ``x [R, V]`` (fp32) with ``-inf`` at the tokens each row's grammar forbids next; rows
    without one are left alone. The bitmask is filled on the host and copied without a device sync."""
    rows = [j for j, g in enumerate(grammars) if g is not None]
    if not rows:
        return x
    bitmask = fill_bitmask(grammars, rows, x.shape[-1], pinned=x.device.type == "cuda")
    x = x.clone()  # the caller's logits may be the step's raw logits, which logprobs read after the pick
    compiler = grammars[rows[0]].compiler
    compiler.xgr.apply_token_bitmask_inplace(x, bitmask.to(x.device, non_blocking=True),
                                             vocab_size=compiler.vocab_size, indices=rows)
    return x


def fill_bitmask(grammars: list[Grammar | None], rows: list[int], vocab: int, pinned: bool = False) -> torch.Tensor:
    """int32 ``[len(grammars), ceil(vocab / 32)]`` on the host: row ``j`` of ``rows`` the tokens
    ``grammars[j]`` allows next, bit ``t % 32`` of word ``t // 32`` (other rows unset). Rows are filled
    on the compiler's threads. A row that allows nothing (a state the vocabulary cannot continue, as
    a choice it cannot spell) allows the stop tokens: the request ends there, its grammar refusing."""
    bitmask = torch.empty(len(grammars), -(-vocab // 32), dtype=torch.int32, pin_memory=pinned)
    compiler = grammars[rows[0]].compiler
    compiler.batch.batch_fill_next_token_bitmask([grammars[j].matcher for j in rows], bitmask, indices=rows)
    stuck = [j for j, allows in zip(rows, bitmask[rows].any(dim=1).tolist()) if not allows]
    if stuck:
        bitmask[stuck] = compiler.stop_mask
    return bitmask

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

import json
from dataclasses import dataclass, fields

import torch

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


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
        if self.json is not None and not isinstance(self.json, (dict, str)):
            return f"structured_outputs.json must be a JSON schema (a dict or a string), got {type(self.json).__name__}"
        if not isinstance(self.json_object, bool):
            return f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                return f"structured_outputs.{name} must be a non-empty string, got {v!r}"
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            return f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
        if not isinstance(self.disable_any_whitespace, bool):
            return f"structured_outputs.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}"
        return None

    def key(self) -> tuple:
        """Hashable identity of what is compiled (a dict schema by its canonical JSON)."""
        return tuple(json.dumps(v, sort_keys=True) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v
                     for v in (getattr(self, f.name) for f in fields(self)))


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured_outputs needs xgrammar: pip install 'pagedflash[structured]'") from None
    return xgrammar


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` against one vocabulary (the tokenizer's, padded to
    the model's ``vocab_size``; ``stop_ids``: the tokens that end a finished grammar, the engine's
    EOS ids). Built on the first structured request; compiled grammars are cached by their params."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], max_cached: int = 256):
        xgr = _xgrammar()
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

        tok = getattr(tokenizer, "tok", tokenizer)  # the engine's and the server's wrappers of tokenizers.Tokenizer
        if not isinstance(tok, PreTrainedTokenizerBase):
            tok = PreTrainedTokenizerFast(tokenizer_object=tok)
        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=4)
        self.batch = xgr.BatchGrammarMatcher()  # fills the rows' masks on half the host's cores
        self._cache: dict[tuple, object] = {}
        self._max_cached = max_cached

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; ``ValueError`` naming the field when xgrammar refuses it."""
        key = params.key()
        compiled = self._cache.get(key)
        if compiled is None:
            kind = params.kind
            try:
                compiled = self._compile(params, kind)
            except (RuntimeError, ValueError, TypeError) as e:
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                raise ValueError(f"structured_outputs.{kind}: xgrammar cannot compile it: {reason}") from None
            if len(self._cache) >= self._max_cached:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
        return compiled

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
        """Feed the sampled token; False if the grammar refuses it (the mask makes that impossible)."""
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
    on the compiler's threads."""
    bitmask = torch.empty(len(grammars), -(-vocab // 32), dtype=torch.int32, pin_memory=pinned)
    compiler = grammars[rows[0]].compiler
    compiler.batch.batch_fill_next_token_bitmask([grammars[j].matcher for j in rows], bitmask, indices=rows)
    return bitmask

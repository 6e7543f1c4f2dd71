"""Text in and out of the server: the tokenizer, the chat template, and incremental detokenization.

:class:`TextTokenizer` wraps a ``tokenizers.Tokenizer`` (a model directory's ``tokenizer.json``, or
:func:`tiny_tokenizer` for the random tiny model) with the special-token strings and chat template
of ``tokenizer_config.json``. Chat templates are rendered with Jinja2 as ``transformers`` renders
them (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``bos_token``/``eos_token``,
``add_generation_prompt``).

:class:`IncrementalDetokenizer` turns a stream of token ids into text deltas that never end inside a
multi-byte character and whose concatenation equals ``decode`` of the ids written (an ending stop id
is counted, not written; special tokens skipped or kept); it also cuts the text at the first ``stop``
string (the match is not returned).
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime

# The tiny model's chat template (no model directory): a role header line per message, each
# message closed by EOS, then the assistant's header when a reply is asked for.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The tiny tokenizer's training text: enough distinct pairs for 512 byte-level BPE tokens.
_TINY_CORPUS = """A paged KV cache keeps the keys and values of every request in fixed-size pages drawn from one pool.
The scheduler packs prefill chunks and decode tokens into each step, under a budget of tokens and rows.
Requests that share a system prompt share its full pages, so the prefix cache saves their prefill.
The server streams each request's new tokens as server-sent events; a client that disconnects is aborted.
Hello, world! How are you today? I am fine, thank you, and you? The quick brown fox jumps over the lazy dog.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.71; symbols: ( ) [ ] { } < > = + - * / % # @ & | ~ ^ ' " ` _
Questions, answers, stories and lists: first, second, third; yes or no; north, south, east and west.
Light travels faster than sound, water freezes at zero degrees, and the moon orbits the earth every month."""
TINY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (TINY_LLAMA's eos_token_id is 2)
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's token for one byte
_NINE_CHAR_IDS = re.compile(r"\|\s*length\s*[!=]=\s*9\b")  # a template's test of a tool-call id (Mistral's)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's ``bytes_to_unicode``), inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids (every id decodes to text),
    trained in milliseconds on a fixed text (the same tokens every time); ``<s>`` is prepended to
    each encoded text. Characters outside the text (``é``, emoji) split into one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(TINY_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TINY_CORPUS.splitlines(), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size: the tiny tokenizer's text yields {tok.get_vocab_size()} tokens, asked for "
                         f"{vocab_size}")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _token_content(value) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's contents, or the value itself when it is a Jinja template."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: expected a file or a Jinja template, got {value!r} (no such file, "
                     "and no '{{' or '{%' in it)")


class ChatTemplateError(ValueError):
    """The messages do not fit the template (it raised, or it failed to render)."""


class TextTokenizer:
    """Encode, decode and render chats for the server.

    tok: a ``tokenizers.Tokenizer``. bos_token / eos_token: the strings the chat template may use.
    chat_template: Jinja source, or None (then chat requests are refused).
    """

    def __init__(self, tok, *, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None):
        self.tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._compiled = None
        self._decoders: set[str] | None = None

    @classmethod
    def from_model_dir(cls, path: str, *, chat_template: str | None = None) -> TextTokenizer:
        """``path/tokenizer.json`` (or ``path`` itself when it is that file) with ``tokenizer_config.json``'s
        special tokens and chat template (or ``chat_template.jinja``); ``chat_template`` overrides."""
        from tokenizers import Tokenizer

        directory, file = (os.path.dirname(path), path) if os.path.isfile(path) else (path, os.path.join(path, "tokenizer.json"))
        if not os.path.isfile(file):
            raise FileNotFoundError(f"tokenizer: no tokenizer.json in {path!r} (the server needs one to read and write text)")
        config = {}
        config_file = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(Tokenizer.from_file(file), bos_token=_token_content(config.get("bos_token")),
                   eos_token=_token_content(config.get("eos_token")), chat_template=chat_template or template)

    @classmethod
    def tiny(cls, vocab_size: int = 512, *, chat_template: str | None = None) -> TextTokenizer:
        """:func:`tiny_tokenizer` with :data:`TINY_CHAT_TEMPLATE` (or ``chat_template``)."""
        return cls(tiny_tokenizer(vocab_size), bos_token="<s>", eos_token="</s>",
                   chat_template=chat_template or TINY_CHAT_TEMPLATE)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, without special tokens (EOS, BOS) unless ``skip_special_tokens`` is False."""
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (a byte of a longer character shows as U+FFFD)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's UTF-8 bytes, special tokens included. A token holding part of a multi-byte
        character gives that part's raw bytes (byte-level BPE, SentencePiece's ``<0xNN>`` byte
        fallback), so the bytes of a text's tokens join into the text's UTF-8; other tokens give
        the UTF-8 of :meth:`token_text`."""
        text = self.token_text(token_id)
        if "\ufffd" in text:
            raw = self._raw_bytes(token_id)
            if raw is not None:
                return raw
        return text.encode("utf-8")

    def _raw_bytes(self, token_id: int) -> bytes | None:
        """The bytes a byte-level or byte-fallback token stands for; None for other tokens."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return None
        if _BYTE_FALLBACK.fullmatch(piece) and "ByteFallback" in self._decoder_types:
            return bytes([int(piece[3:5], 16)])
        if "ByteLevel" in self._decoder_types and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return None

    @property
    def _decoder_types(self) -> set[str]:
        """The ``type`` of the decoder and of each decoder in a ``Sequence``."""
        if self._decoders is None:
            decoder = self.tok.decoder
            spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
            self._decoders = {d.get("type") for d in spec.get("decoders", [spec])}
        return self._decoders

    @property
    def nine_char_tool_ids(self) -> bool:
        """Whether the chat template refuses tool-call ids of other than 9 characters (Mistral's test
        ``tool_call.id|length == 9``), so that a client's ids must be fitted to it
        (:func:`pagedflash.entrypoints.openai.tools.nine_char_id`)."""
        return bool(self.chat_template and _NINE_CHAR_IDS.search(self.chat_template))

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The prompt text of ``messages`` (dicts with ``role`` and string ``content``); ``tools``: the
        function tools (OpenAI's format), the template's ``tools`` as transformers passes them.

        Raises ``ValueError`` when there is no template, :class:`ChatTemplateError` when it refuses the
        messages."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template (none in tokenizer_config.json): start the server "
                             "with --chat-template, or use /v1/completions")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self._compiled is None:
            def raise_exception(message):
                raise ChatTemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
                json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._compiled = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"chat template does not compile: {e}") from None
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from None


class IncrementalDetokenizer:
    """Text deltas of a growing list of token ids.

    Each :meth:`push` decodes a window of recent ids twice, with and without the ids not yet turned
    into text (the window starts at the ids of the previous delta, so that a decoder's handling of
    a window's first token cancels out), and returns the new characters unless they end in U+FFFD, the mark of a multi-byte
    character still incomplete; those are returned once its last byte arrives. :meth:`finish`
    returns what the full decode has beyond the deltas. ``stop`` strings: the text is cut before
    the first match (after it with ``include_stop``; ``stopped`` is set), and while the request runs
    the last ``max(len) - 1`` characters are held back, as they may be the start of a match.
    ``skip_special_tokens``: special tokens' text left out (True) or written (False).
    """

    def __init__(self, tokenizer: TextTokenizer, stop: list[str] | tuple[str, ...] = (), *,
                 skip_special_tokens: bool = True, include_stop: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.ids: list[int] = []
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # ids whose text is in self.text
        self.text = ""  # decoded so far (cut at a stop match)
        self.num_emitted = 0  # characters of self.text handed out
        self.stopped = False  # a stop string matched; later ids are ignored
        self.num_tokens = 0  # ids taken, up to and including the one that completed a stop match

    def push(self, token_ids: list[int], *, ends_on_stop_id: bool = False) -> str:
        """Take new ids; the text that may be sent now. ``ends_on_stop_id``: the last id is the EOS or
        stop id that ended the request, counted in ``num_tokens`` but not written (vLLM's text leaves
        it out)."""
        for j, token in enumerate(token_ids):
            if self.stopped:
                break
            self.num_tokens += 1
            if ends_on_stop_id and j == len(token_ids) - 1:
                break
            self.ids.append(token)
            prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
            full = self._decode(self.ids[self._prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self._append(full[len(prefix):])
                self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """The rest of the text once the request ended (a trailing incomplete character included, as
        ``decode`` writes it)."""
        if not self.stopped:
            full = self._decode(self.ids)
            emitted = self.text
            if full.startswith(emitted):
                self._append(full[len(emitted):])
        return self._take(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, delta: str) -> None:
        start = max(0, len(self.text) - self._hold)  # a match that uses the new characters starts here or later
        self.text += delta
        hits = [(i, -len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if hits:
            first, minus_len = min(hits)  # the earliest match, the longest of those starting there
            self.text = self.text[:first - minus_len if self.include_stop else first]
            self.stopped = True

    def _take(self, *, final: bool) -> str:
        end = len(self.text) if final else max(self.num_emitted, len(self.text) - self._hold)
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out

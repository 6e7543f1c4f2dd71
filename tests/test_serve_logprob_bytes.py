"""Chat logprobs' ``bytes`` for tokens that hold part of a multi-byte character (byte-level BPE and
SentencePiece byte fallback split such characters): the token's own bytes, its ``token`` text U+FFFD,
so the ``bytes`` of a reply's tokens join into the UTF-8 of its streamed and non-streamed content."""

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from pagedflash.entrypoints.openai.responses import chat_logprobs  # noqa: E402
from pagedflash.entrypoints.openai.tokenizer import TextTokenizer  # noqa: E402

TEXT = "héllo wörld 😀 ✓ naïve — 日本語 done"
REPLACEMENT = list("\ufffd".encode())


def joined(content) -> bytes:
    return b"".join(bytes(e.bytes) for e in content)


def check_entries(tok, ids, text):
    """chat_logprobs of ``ids`` (each its own top 1): bytes join into ``text``; split characters show U+FFFD."""
    content = chat_logprobs(tok, [(i, {i: -0.5}) for i in ids], 1).content
    assert joined(content).decode("utf-8") == text
    split = [e for e in content if "\ufffd" in e.token]
    assert len(split) >= 4, "the text must split characters across tokens"
    assert all(e.bytes != REPLACEMENT for e in split)
    assert all(e.top_logprobs[0].bytes == e.bytes and e.top_logprobs[0].token == e.token for e in content)


def test_byte_level_bpe_tokens_carry_their_own_bytes():
    tok = TextTokenizer.tiny()
    ids = tok.encode(TEXT, add_special_tokens=False)
    check_entries(tok, ids, TEXT)
    assert tok.token_bytes(2) == b"</s>"  # special tokens: their text


def test_sentencepiece_byte_fallback_tokens_carry_their_own_bytes():
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": b + 1 for b in range(256)}, "a": 257, "▁": 258}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = TextTokenizer(raw)
    text = "aé😀a日"
    check_entries(tok, raw.encode(text).ids, text)


# ------------------------------------------------------------------ through the server
@pytest.fixture(scope="module")
def server():
    from test_serve import LiveServer

    s = LiveServer("--max-num-seqs", "4")
    yield s
    s.stop()


def test_chat_logprob_bytes_join_into_the_content_streamed_and_not(server):
    """The tiny model's greedy reply to this message (under the interpreter) has a lone byte token
    (text U+FFFD): its ``bytes`` are that byte, and the bytes of the reply's tokens decode to the content."""
    from test_serve import GREEDY, MODEL

    client = server.client()
    messages = [{"role": "user", "content": "héllo"}]
    asked = dict(model=MODEL, messages=messages, max_tokens=7, logprobs=True, top_logprobs=1, **GREEDY)
    whole = client.chat.completions.create(**asked)
    content, text = whole.choices[0].logprobs.content, whole.choices[0].message.content
    split = [e for e in content if "\ufffd" in e.token]
    assert all(len(e.bytes) == 1 and e.bytes[0] >= 0x80 for e in split), content
    if not torch.cuda.is_available():  # a GPU draws the random weights with its own generator: another reply
        assert split, content
    assert joined(content).decode("utf-8", errors="replace") == text
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    server.assert_pool_whole()

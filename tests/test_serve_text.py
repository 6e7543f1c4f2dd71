"""The server's text handling without a server: incremental detokenization (multi-byte characters
split across tokens, stop strings) and chat templates. Needs ``tokenizers`` and ``jinja2`` only."""

import random

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from pagedflash.entrypoints.openai.tokenizer import (  # noqa: E402
    ChatTemplateError,
    IncrementalDetokenizer,
    TextTokenizer,
    load_chat_template,
    tiny_tokenizer,
)

TEXT = "héllo wörld 😀 ✓ naïve — 日本語 done"


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.tiny()


def stream(tok, ids, stop=(), chunk=1):
    detok = IncrementalDetokenizer(tok, stop)
    deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return detok, deltas


def test_tiny_tokenizer_is_fixed_and_fills_the_vocabulary():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 512
    assert [a.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    assert a.encode("hi").ids[0] == 1  # BOS


def test_multibyte_characters_split_across_tokens_are_never_broken(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in piece for piece in pieces) >= 4, "the text must split characters across tokens"
    for chunk in (1, 2, 3):
        detok, deltas = stream(tok, ids, chunk=chunk)
        assert not any("\ufffd" in d for d in deltas), deltas
        assert "".join(deltas) == tok.decode(ids) == TEXT
        assert detok.num_tokens == len(ids)


def test_random_ids_concatenate_to_the_full_decode(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(512) for _ in range(rng.randrange(1, 30))]
        _, deltas = stream(tok, ids, chunk=rng.randrange(1, 4))
        assert "".join(deltas) == tok.decode(ids)


@pytest.mark.parametrize("stop", [["wörld"], ["😀"], ["o w", "日本"], ["✓ na", "xyz"], ["done"], ["absent"]])
def test_stop_strings_cut_the_text_before_the_first_match(tok, stop):
    ids = tok.encode(TEXT, add_special_tokens=False)
    hits = [TEXT.find(s) for s in stop if s in TEXT]
    expected = TEXT[:min(hits)] if hits else TEXT
    for chunk in (1, 3):
        detok, deltas = stream(tok, ids, stop=stop, chunk=chunk)
        assert "".join(deltas) == expected
        assert detok.stopped == bool(hits)
        if hits:  # tokens counted: up to the one completing the match, not beyond
            taken = tok.decode(ids[:detok.num_tokens])
            assert any(taken.startswith(expected + s) for s in stop)
            assert not any(expected + s in tok.decode(ids[:detok.num_tokens - 1]) for s in stop)


def test_stop_string_text_is_held_back_until_it_cannot_match(tok):
    ids = tok.encode("abc xyz abd", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, ["abd!"])
    sent = "".join(detok.push([i]) for i in ids)
    assert "abc xyz abd".startswith(sent) and len(sent) <= len("abc xyz abd") - 3  # "abd" could start "abd!"
    assert sent + detok.finish() == "abc xyz abd"


def test_chat_template_renders_and_refuses(tok, tmp_path):
    text = tok.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<s><|system|>\nbe brief</s>\n<|user|>\nhi</s>\n<|assistant|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # BOS and EOS strings become their ids

    strict = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}" \
             "{{ m['content'] }}{% endfor %}"
    file = tmp_path / "t.jinja"
    file.write_text(strict)
    assert load_chat_template(str(file)) == strict == load_chat_template(strict)
    with pytest.raises(ValueError, match="--chat-template: expected a file or a Jinja template"):
        load_chat_template("no/such/file.jinja")
    custom = TextTokenizer(tok.tok, chat_template=strict)
    assert custom.render_chat([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(ChatTemplateError, match="no system"):
        custom.render_chat([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        TextTokenizer(tok.tok).render_chat([{"role": "user", "content": "x"}])


def test_model_dir_tokenizer_config(tok, tmp_path):
    tok.tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}')
    loaded = TextTokenizer.from_model_dir(str(tmp_path))
    assert loaded.render_chat([{"role": "user", "content": "q"}]) == "<s>q</s>"
    assert loaded.encode(TEXT) == tok.encode(TEXT)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        TextTokenizer.from_model_dir(str(tmp_path / "missing"))


CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}{{ {'a': 'é'} | tojson }}")


@pytest.mark.parametrize("template", [CHATML, None], ids=["chatml", "tiny-default"])
def test_chat_template_renders_as_transformers_does(tok, template):
    transformers = pytest.importorskip("transformers")
    ours = TextTokenizer(tok.tok, bos_token="<s>", eos_token="</s>", chat_template=template or tok.chat_template)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = ours.chat_template
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ok"}]
    for add in (True, False):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.render_chat(messages, add_generation_prompt=add) == want


def test_special_tokens_are_left_out_or_written(tok):
    """``skip_special_tokens``: BOS (``<s>``) between pieces of text is dropped (the default) or
    written; an id that ends the request (``ends_on_stop_id``) is counted and never written."""
    ids = tok.encode("hi there", add_special_tokens=False)
    mixed = ids[:1] + [1] + ids[1:] + [1]
    for skip, want in ((True, "hi there"), (False, tok.decode(mixed, skip_special_tokens=False))):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        text = "".join(detok.push([i]) for i in mixed) + detok.finish()
        assert text == want and detok.num_tokens == len(mixed)
    assert "<s>" in want
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = detok.push(ids) + detok.push([1, 2], ends_on_stop_id=True) + detok.finish()
    assert text == tok.decode(ids + [1], skip_special_tokens=False) and detok.num_tokens == len(ids) + 2


def test_include_stop_keeps_the_match(tok):
    """``include_stop`` (vLLM's ``include_stop_str_in_output``): the text runs to the end of the
    first match, streamed or whole."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    cut = TEXT.index("wörld")
    for stop, end in ((["wörld"], cut + 5), (["llo", "wörld"], TEXT.index("llo") + 3)):
        for chunk in (1, 4):
            detok = IncrementalDetokenizer(tok, stop, include_stop=True)
            text = "".join(detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + detok.finish()
            assert text == TEXT[:end] and detok.stopped, (stop, chunk, text)
    _, deltas = stream(tok, ids, ["wörld"])
    assert "".join(deltas) == TEXT[:cut]  # without it: cut before the match

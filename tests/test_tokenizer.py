"""Tokenizers, chat templates and incremental detokenization, for bytes and for SmolLM2."""

from __future__ import annotations

import pytest

from cluster.api.choice import TextStream
from replica.checkpoints import SMOLLM2, checkpoint_for
from replica.checkpoints.tokenizer import ByteTokenizer, IncrementalDetokenizer, Tokenizer

HARD_TEXTS = [
    "The capital of France is Paris.",
    "Emoji split over tokens: 🧨🇫🇷🏔️ done",
    "日本の富士山は美しい。 Ünïcödé naïve café",
    "  leading spaces,\ttabs\nand newlines  ",
    "code: def f(x):\n    return x[::-1]",
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return checkpoint_for(SMOLLM2).tokenizer()


def tokenizers(smollm2: Tokenizer) -> list[Tokenizer]:
    return [ByteTokenizer(), smollm2]


def stream_one_by_one(tok: Tokenizer, prompt: list[int], generated: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push([t]) for t in generated]
    return [*pieces, detok.flush()]


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_streaming_one_token_at_a_time_equals_decoding_the_whole(smollm2, text) -> None:
    for tok in tokenizers(smollm2):
        prompt = tok.encode("Say it: ")
        generated = tok.encode(text)[len(tok.encode("")) :]
        pieces = stream_one_by_one(tok, prompt, generated)
        assert "".join(pieces) == tok.decode(generated)
        assert not any("\ufffd" in p for p in pieces)  # no broken character ever shown


def test_the_emoji_really_is_split_over_tokens(smollm2) -> None:
    ids = smollm2.encode("🧨")
    assert len(ids) > 1  # otherwise the streaming test above proves nothing
    assert all(smollm2.decode([i]) in ("", "\ufffd") for i in ids)


def test_a_word_split_over_tokens_keeps_its_space(smollm2) -> None:
    prompt = smollm2.encode("Hello")
    generated = smollm2.encode(" unbelievably wonderful")
    assert len(generated) > 2
    assert "".join(stream_one_by_one(smollm2, prompt, generated)) == " unbelievably wonderful"


def test_special_tokens_never_reach_the_text(smollm2) -> None:
    end = smollm2.stop_token_ids
    assert set(end) == {0, 2}  # <|endoftext|>, <|im_end|>
    generated = [*smollm2.encode("Paris."), 2]
    assert "".join(stream_one_by_one(smollm2, [], generated)) == "Paris."


def test_the_chat_template_is_the_models_own(smollm2) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    text = smollm2.render_chat(messages)
    assert text == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = smollm2.encode_chat(text)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> and <|im_end|> as single tokens
    assert ByteTokenizer().render_chat(messages) == "<|system|>\nBe terse.\n<|user|>\nHi\n" + (
        "<|assistant|>\n"
    )


def test_a_stop_string_split_across_tokens_is_cut_and_never_streamed(smollm2) -> None:
    for tok in tokenizers(smollm2):
        generated = tok.encode("one two three STOP four")[len(tok.encode("")) :]
        stream = TextStream(IncrementalDetokenizer(tok, []), ["STOP"])
        shown = [stream.push([t]) for t in generated]
        assert stream.stopped and stream.flush() == ""
        assert "".join(shown) == stream.text == "one two three "  # nothing of "STOP" shown


def test_a_cached_gguf_tokenizer_is_the_fresh_conversion(tmp_path, monkeypatch) -> None:
    """The folder ``tokenizer_cache`` keeps against transformers' conversion of the GGUF
    file itself: ids, texts, chat renderings (with tools) and stop tokens."""
    from replica.checkpoints import smollm2_path
    from replica.checkpoints.tokenizer import HFTokenizer
    from replica.checkpoints.tokenizer_cache import tokenizer_folder

    monkeypatch.setenv("PREFIX_SERVE_CACHE_DIR", str(tmp_path))
    path = smollm2_path()
    folder = tokenizer_folder(path)
    assert folder is not None and folder.parent.parent == tmp_path
    assert tokenizer_folder(path) == folder  # found, not converted again
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no leftovers
    cached = HFTokenizer(str(folder))
    fresh = HFTokenizer(str(path.parent), gguf_file=path.name)
    for text in [*HARD_TEXTS, "<|im_start|>user\nhi<|im_end|><|endoftext|>", ""]:
        assert cached.encode(text) == fresh.encode(text)
        ids = fresh.encode(text)
        assert cached.decode(ids) == fresh.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert cached.render_chat(messages) == fresh.render_chat(messages)
    assert cached.render_chat(messages, tools) == fresh.render_chat(messages, tools)
    for name in ("vocab_size", "stop_token_ids", "template_has_tools", "document_start_id"):
        assert getattr(cached, name) == getattr(fresh, name), name
    assert cached.hf.get_vocab() == fresh.hf.get_vocab()


def test_an_unwritable_cache_falls_back_to_converting(tmp_path, monkeypatch) -> None:
    from replica.checkpoints import smollm2_path
    from replica.checkpoints.tokenizer_cache import tokenizer_folder

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("PREFIX_SERVE_CACHE_DIR", str(blocked))
    assert tokenizer_folder(smollm2_path()) is None

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

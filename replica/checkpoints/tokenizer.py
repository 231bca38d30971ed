"""Tokenizers: the model's own (BPE from its GGUF file or Hugging Face folder) or bytes.

Both render chat messages with the model's chat template and decode token ids to text;
``IncrementalDetokenizer`` turns a stream of generated ids into text pieces that never show
a broken UTF-8 character or a wrong space at a token boundary, whatever the tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

# Control tokens that end a turn or a text in the chat models we know, besides the one a
# checkpoint names as EOS: generation stops at any of them and never shows them.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


class Tokenizer(Protocol):
    """What the ingress and the engine need from a tokenizer."""

    vocab_size: int
    stop_token_ids: tuple[int, ...]  # EOS and the end-of-turn tokens
    template_has_tools: bool  # the chat template renders a list of tools itself
    document_start_id: int  # what an empty prompt is served as (OpenAI: <|endoftext|>)

    def encode(self, text: str) -> list[int]:
        """A prompt's ids, with whatever the model puts first (a BOS token, if any); empty
        for an empty text where the model puts nothing first."""
        ...

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a prompt ``render_chat`` made (its template places any special tokens)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens left out."""
        ...

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None = None
    ) -> str:
        """The prompt for a conversation (``role``/``content``), ending where the
        assistant's reply begins; ``tools`` only where ``template_has_tools``."""
        ...

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (for logprobs)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; BOS = 256, EOS = 257 (the tiny random model's).

    ``encode`` keeps lone surrogates (as their UTF-8-like bytes) rather than failing on
    them; ``decode`` skips special tokens and replaces invalid UTF-8. Its chat template is
    ``<|role|>\\n{content}\\n`` per message, then ``<|assistant|>\\n``.
    """

    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257
    stop_token_ids = (257,)
    template_has_tools = False
    document_start_id = 256

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8", errors="surrogatepass")]

    def encode_chat(self, text: str) -> list[int]:
        return self.encode(text)  # the template has no BOS of its own

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None = None
    ) -> str:
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        return "".join(parts) + "<|assistant|>\n"

    def token_text(self, token_id: int) -> str:
        if token_id >= 256:
            return "<bos>" if token_id == self.bos_token_id else "<eos>"
        return bytes([token_id]).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer with the model's chat template (``transformers``).

    Loaded from a GGUF file (``gguf_file``: transformers builds the BPE tokenizer from the
    file's vocabulary and merges and reads its chat template) or from a folder holding
    ``tokenizer.json``.
    """

    def __init__(self, folder: str, gguf_file: str | None = None) -> None:
        from transformers import AutoTokenizer  # heavy: only where a real model is served

        kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        self._tok = AutoTokenizer.from_pretrained(folder, **kwargs)
        if not self._tok.chat_template:
            raise ValueError(f"{gguf_file or folder}: the tokenizer has no chat template")
        self.vocab_size = len(self._tok)
        vocab = self._tok.get_vocab()
        stops = {self._tok.eos_token_id, *(vocab[t] for t in END_TOKENS if t in vocab)}
        self.stop_token_ids = tuple(sorted(t for t in stops if t is not None))
        self.template_has_tools = "tools" in str(self._tok.chat_template)
        starts = (vocab.get("<|endoftext|>"), self._tok.bos_token_id, self._tok.eos_token_id)
        self.document_start_id = next(t for t in starts if t is not None)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer itself (for xgrammar's vocabulary)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None = None
    ) -> str:
        extra = {"tools": tools} if tools and self.template_has_tools else {}
        return self._tok.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False, **extra
        )

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a rendered chat prompt: the template already holds the special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def save(self, folder: str) -> None:
        """Write ``tokenizer.json`` and its config (chat template included) to ``folder``."""
        self._tok.save_pretrained(folder)


class IncrementalDetokenizer:
    """Generated ids to text, piece by piece, correct for any tokenizer.

    Each new id re-decodes a short window of ids: the text up to the window's read point
    is known, so the piece is the rest of the window's text. A piece that ends in U+FFFD
    (a multi-byte character split over tokens) is held until its character completes, and
    the window starts a few prompt ids back, so a word's leading space decodes as it does
    in context. Special tokens never appear.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], context: int = 5) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-context:])
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this are already shown

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text that is now complete."""
        self._ids.extend(token_ids)
        shown = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(shown) :]

    def flush(self) -> str:
        """Whatever is held back once generation ended (an incomplete character shows as
        U+FFFD, as a whole decode would show it)."""
        shown = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(shown) :]

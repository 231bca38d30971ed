"""Byte-level tokenizer: the default, so the whole system runs with no download."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    """What the engine and the ingress need from a tokenizer."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; BOS = 256, EOS = 257.

    ``encode`` keeps lone surrogates (as their UTF-8-like bytes) rather than failing on
    them; ``decode`` skips special tokens and replaces invalid UTF-8.
    """

    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8", errors="surrogatepass"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

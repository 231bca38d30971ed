"""Token log-probabilities in OpenAI's two shapes: the completions API's parallel lists
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and the chat API's list
of entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from replica.sampling.params import TokenLogprob

TokenText = Callable[[int], str]


def _bytes(text: str) -> list[int] | None:
    """A token's UTF-8 bytes (None where the token is part of a character)."""
    return None if "\ufffd" in text else list(text.encode("utf-8"))


def completion_logprobs(
    tokens: Sequence[tuple[int, TokenLogprob | None]], token_text: TokenText, offset: int = 0
) -> dict[str, Any]:
    """The completions API's ``logprobs`` for these (token id, logprob) pairs (no logprob:
    the first token of an echoed prompt), their text offsets counted from ``offset``."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, entry in tokens:
        text = token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        top: dict[str, float] = {}
        for t, lp in entry.top if entry is not None else ():
            top.setdefault(token_text(t), lp)  # ids sharing a text: the likeliest (first)
        out["top_logprobs"].append(top or None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """The chat API's ``logprobs`` for these tokens."""
    content = []
    for entry in entries:
        text = token_text(entry.token_id)
        top = [
            {"token": token_text(t), "logprob": lp, "bytes": _bytes(token_text(t))}
            for t, lp in entry.top
        ]
        content.append(
            {"token": text, "logprob": entry.logprob, "bytes": _bytes(text), "top_logprobs": top}
        )
    return {"content": content, "refusal": None}

"""Eight chat prompts for the real model: mixed lengths (one over 1,000 tokens), three sharing
the support system prompt, several scripts and emoji. Used by the transformers-equivalence
and the invariance tests."""

from __future__ import annotations

from bench.assistant_prompts import (
    LONG_DOCUMENT,
    SUPPORT_QUESTIONS,
    SUPPORT_SYSTEM_PROMPT,
)
from replica.checkpoints.tokenizer import Tokenizer

CONVERSATIONS = [
    ("You are terse.", "What is the capital of France?"),
    (SUPPORT_SYSTEM_PROMPT, SUPPORT_QUESTIONS[0]),
    (SUPPORT_SYSTEM_PROMPT, SUPPORT_QUESTIONS[4]),
    (SUPPORT_SYSTEM_PROMPT, "Summarise this report:\n" + LONG_DOCUMENT * 3),  # > 1,000 tokens
    ("Réponds en français, avec des émojis 🇫🇷🏔️.", "Qu'est-ce que 日本の富士山 ? 🗻"),
    ("You write Python.", "Write a function that reverses a string."),
    ("Be helpful.", "List three colours."),
    ("Ты полезный помощник.", "Сколько будет 2 + 2? Ответь кратко."),
]
SHARING_THE_SYSTEM_PROMPT = (1, 2, 3)


def encode(tokenizer: Tokenizer, system: str, user: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.encode_chat(tokenizer.render_chat(messages))


def chat_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [encode(tokenizer, s, q) for s, q in CONVERSATIONS]

"""The chat template: how messages become one prompt string.

Each message is ``<|role|>\\n{content}\\n`` (``developer`` is rendered as ``system``), and the
prompt ends with ``<|assistant|>\\n`` for the reply. The system prompt comes first, so every
conversation with the same system prompt shares its leading blocks, and each turn of a
conversation extends the previous turn's prompt (its blocks stay cached).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Message(Protocol):
    role: str

    @property
    def text(self) -> str: ...


def render_chat(messages: Sequence[Message]) -> str:
    parts = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        parts.append(f"<|{role}|>\n{m.text}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)

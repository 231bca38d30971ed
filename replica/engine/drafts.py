"""Prompt-lookup drafting: a decoding sequence's next tokens guessed from its own text.

A sequence that copies (a summary quoting its document, an edit of given code, an answer
citing a passage) repeats runs of tokens it has already seen. For each decoding sequence the
drafter finds the most recent earlier occurrence of its last ``n`` tokens (the longest ``n``
from ``ngram_max`` down to ``ngram_min`` that occurs) and proposes the tokens that followed
it. The engine verifies the drafts in the next step together with the decode token
(``replica.engine.speculation``): a draft is kept only where it equals the token plain
decoding picks there, so drafting changes how many tokens a step yields, never which.

The n-gram index of a sequence is built incrementally: each token is indexed once, when
the sequence first drafts past it, so a step costs a dictionary lookup per ``n`` whatever
the context length (vLLM's ``ngram`` proposer rescans the context each step).

The draft length adapts per sequence (``SpeculationOptions.adaptive``), as Hugging Face's
assisted generation does: two more after a step that accepted every draft, one fewer
after a step that rejected one, between 1 and ``max_draft_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from replica.config import SpeculationOptions


@dataclass
class DraftState:
    """One sequence's n-gram index and draft length.

    ``ends[gram]`` is the position right after the latest occurrence of ``gram`` among the
    grams ending before ``indexed`` (a position of the sequence's tokens); ``length`` is how
    many tokens the next draft may have."""

    length: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0


class Drafter:
    """Proposes drafts and adapts their length (module docstring)."""

    def __init__(self, options: SpeculationOptions) -> None:
        self.options = options

    def new_state(self) -> DraftState:
        return DraftState(self.options.max_draft_tokens)

    def propose(self, state: DraftState, tokens: list[int], limit: int) -> list[int]:
        """At most ``min(state.length, limit)`` tokens expected after ``tokens``: those that
        followed the latest earlier occurrence of its longest matching suffix (none: [])."""
        limit = min(limit, state.length)
        if limit <= 0:
            return []
        self._index(state, tokens)
        n_min, n_max = self.options.ngram_min, self.options.ngram_max
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            end = state.ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end : end + limit]
        return []

    def record(self, state: DraftState, drafted: int, accepted: int) -> None:
        """A verified step of ``drafted`` tokens kept ``accepted``: the next length."""
        if not self.options.adaptive or not drafted:
            return
        top = self.options.max_draft_tokens
        state.length = (
            min(top, state.length + 2) if accepted == drafted else max(1, state.length - 1)
        )

    def _index(self, state: DraftState, tokens: list[int]) -> None:
        """Index every gram ending before the last token's position + 1, except the suffix
        itself (a gram ending at ``len(tokens)``: matching it would propose nothing)."""
        n_min, n_max = self.options.ngram_min, self.options.ngram_max
        for end in range(max(state.indexed, n_min), len(tokens)):
            for n in range(n_min, min(n_max, end) + 1):
                state.ends[tuple(tokens[end - n : end])] = end
        state.indexed = max(state.indexed, len(tokens))

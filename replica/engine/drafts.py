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
after a step that rejected one, between 1 and ``max_draft_tokens``; and no more than the
sequence's recent keep rate pays for in a step of the size scheduled
(``replica.engine.step_cost``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from replica.config import SpeculationOptions
from replica.engine.step_cost import StepCost

_RATE_DECAY = 0.9  # a verified step's weight in a sequence's keep rate fades by this


@dataclass
class DraftState:
    """One sequence's n-gram index and draft length.

    ``ends[gram]`` is the position right after the latest occurrence of ``gram`` among the
    grams ending before ``indexed`` (a position of the sequence's tokens); ``length`` is how
    many tokens the next draft may have."""

    length: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0
    kept: float = 3.0  # drafts kept, and drafts tried (kept + first rejected), recent
    tried: float = 4.0  # steps weighing most; 3 of 4 before any: a prior of 0.75

    @property
    def keep_rate(self) -> float:
        """The chance that a drafted token is kept, given the ones before it were."""
        return self.kept / self.tried


class Drafter:
    """Proposes drafts and adapts their length (module docstring)."""

    def __init__(self, options: SpeculationOptions) -> None:
        self.options = options
        self.cost = StepCost()  # the engine records every step's tokens and seconds

    def new_state(self) -> DraftState:
        return DraftState(self.options.max_draft_tokens)

    def propose(
        self, state: DraftState, tokens: list[int], limit: int, threshold: float = 0.0
    ) -> list[int]:
        """At most ``min(state.length, limit)`` tokens expected after ``tokens``: those that
        followed the latest earlier occurrence of its longest matching suffix (none: []).
        With ``adaptive``, only as many as are each likely enough to be kept to pay for
        their place in the step: the k-th is kept with chance ``keep_rate ** k``, which
        must reach ``threshold`` (``StepCost.draft_threshold``)."""
        limit = min(limit, state.length, self._worth(state, threshold))
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
        """A verified step of ``drafted`` tokens kept ``accepted``: the next length, and
        the sequence's keep rate (the first rejected draft counts as tried)."""
        if not self.options.adaptive or not drafted:
            return
        state.kept = _RATE_DECAY * state.kept + accepted
        state.tried = _RATE_DECAY * state.tried + accepted + (accepted < drafted)
        top = self.options.max_draft_tokens
        state.length = (
            min(top, state.length + 2) if accepted == drafted else max(1, state.length - 1)
        )

    def _worth(self, state: DraftState, threshold: float) -> int:
        """How many drafts each keep their place: the largest k with ``keep_rate ** k``
        at least ``threshold`` (all of them without ``adaptive`` or a threshold)."""
        top = self.options.max_draft_tokens
        if not self.options.adaptive or threshold <= 0.0:
            return top
        rate = state.keep_rate
        if rate >= 1.0:
            return top
        if rate <= 0.0 or rate < threshold:
            return 0
        return min(top, int(math.log(threshold) / math.log(rate)))

    def _index(self, state: DraftState, tokens: list[int]) -> None:
        """Index every gram ending before the last token's position + 1, except the suffix
        itself (a gram ending at ``len(tokens)``: matching it would propose nothing)."""
        n_min, n_max = self.options.ngram_min, self.options.ngram_max
        for end in range(max(state.indexed, n_min), len(tokens)):
            for n in range(n_min, min(n_max, end) + 1):
                state.ends[tuple(tokens[end - n : end])] = end
        state.indexed = max(state.indexed, len(tokens))

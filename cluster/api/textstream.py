"""Generated token ids to text, piece by piece, with OpenAI ``stop`` strings."""

from __future__ import annotations

from collections.abc import Sequence

from replica.checkpoints.tokenizer import IncrementalDetokenizer


class TextStream:
    """Decodes generated tokens incrementally and cuts the text at the first stop string.

    Text that could still turn out to be the start of a stop string is held back until it
    cannot, so a stream never shows a stop string (OpenAI's behaviour). Characters split
    across tokens are emitted once complete (``IncrementalDetokenizer``).
    """

    def __init__(self, detokenizer: IncrementalDetokenizer, stop: Sequence[str] = ()) -> None:
        self._detokenizer = detokenizer
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._emitted = 0
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now safe to show."""
        if self.stopped:
            return ""
        self._text += self._detokenizer.push(token_ids)
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            return self._emit(cut)
        return self._emit(max(self._emitted, len(self._text) - self._hold))

    def flush(self) -> str:
        """The held-back rest, once the request has finished."""
        if self.stopped:
            return ""
        self._text += self._detokenizer.flush()
        cut = self._first_stop()
        self.stopped = cut is not None
        return self._emit(len(self._text) if cut is None else cut)

    @property
    def text(self) -> str:
        return self._text[: self._emitted]

    def _first_stop(self) -> int | None:
        start = max(0, self._emitted - self._hold)
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _emit(self, upto: int) -> str:
        piece = self._text[self._emitted : upto]
        self._emitted = upto
        return piece

"""One choice of a reply as its tokens stream in: text (generated ids decoded piece by piece,
OpenAI ``stop`` strings applied, never shown),
tokens counted once, logprobs kept, why it ended, and (chat with tools) its text as content
or as a tool call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.api.tools import ToolCallStream
from replica.checkpoints.tokenizer import IncrementalDetokenizer
from replica.messages import RequestOutput
from replica.sampling.params import TokenLogprob

TokenLogprobs = list[tuple[int, TokenLogprob | None]]


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


class Choice:
    def __init__(
        self,
        index: int,
        detokenizer: IncrementalDetokenizer,
        stop: Sequence[str],
        stop_token_ids: Sequence[int] = (),
        score_only: bool = False,
        calls: ToolCallStream | None = None,
        chat: bool = False,
    ) -> None:
        self.index = index
        self.text = TextStream(detokenizer, stop)
        self.stop_token_ids = frozenset(stop_token_ids)  # end the text, never shown
        self.score_only = score_only  # max_tokens 0: the generated token is dropped
        self.tokens = 0
        self.logprobs: TokenLogprobs = []
        self.finish_reason: str | None = None
        self.calls = calls
        self.chat = chat or calls is not None
        self._deltas: list[dict[str, Any]] = []  # chat deltas not yet sent

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, chunk: RequestOutput) -> tuple[str, TokenLogprobs]:
        """Take a chunk of this choice; the text now safe to show and its tokens' logprobs."""
        if self.finished:
            return "", []
        if self.score_only:
            self.finish_reason = "length"
            return "", []
        self.tokens += len(chunk.new_token_ids)
        shown = chunk.new_token_ids
        if chunk.finished and shown and shown[-1] in self.stop_token_ids:
            shown = shown[:-1]
        piece = self.text.push(shown)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif chunk.finished:
            piece += self.text.flush()
            self.finish_reason = "stop" if self.text.stopped else chunk.finish_reason
        entries: TokenLogprobs = []
        if chunk.logprobs is not None:
            entries = list(zip(chunk.new_token_ids, chunk.logprobs, strict=True))
            self.logprobs += entries
        self._chat(piece)
        return piece, entries

    def _chat(self, piece: str) -> None:
        if not self.chat:
            return
        if self.calls is None:
            self._deltas += [{"content": piece}] if piece else []
            return
        self._deltas += self.calls.push(piece)
        if self.finished:
            self._deltas += self.calls.finish()
            if self.calls.is_call and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"

    def deltas(self) -> list[dict[str, Any]]:
        """The chat deltas the text so far makes (content, or a tool call's parts)."""
        out, self._deltas = self._deltas, []
        return out

    def message(self) -> dict[str, Any]:
        """The whole reply as a chat message."""
        if self.calls is None:
            return {"role": "assistant", "content": self.text.text}
        return self.calls.message()

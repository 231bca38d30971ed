"""One choice of a reply as its tokens stream in: text (stop strings applied, never shown),
tokens counted once, logprobs kept, and why it ended."""

from __future__ import annotations

from collections.abc import Sequence

from cluster.api.textstream import TextStream
from replica.checkpoints.tokenizer import IncrementalDetokenizer
from replica.messages import RequestOutput, TokenLogprob

TokenLogprobs = list[tuple[int, TokenLogprob | None]]


class Choice:
    def __init__(
        self,
        index: int,
        detokenizer: IncrementalDetokenizer,
        stop: Sequence[str],
        stop_token_ids: Sequence[int] = (),
        score_only: bool = False,
    ) -> None:
        self.index = index
        self.text = TextStream(detokenizer, stop)
        self.stop_token_ids = frozenset(stop_token_ids)  # end the text, never shown
        self.score_only = score_only  # max_tokens 0: the generated token is dropped
        self.tokens = 0
        self.logprobs: TokenLogprobs = []
        self.finish_reason: str | None = None

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
        return piece, entries

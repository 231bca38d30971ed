"""Structured outputs: decoding constrained to a JSON grammar (xgrammar).

A constrained request carries a ``StructuredOutput`` (any JSON object, or a JSON schema). Its
sequence holds a ``GrammarState``: xgrammar's matcher, advanced by every token the sequence
commits. Before each draw the sampler masks the request's logits to the tokens the grammar
allows next (a copy: logprobs stay the model's own); once the grammar is complete only an
end token is allowed, and the request finishes. The mask depends only on the tokens so far,
so a constrained request, like any other, gives the same tokens alone, batched, after a
cache hit or resumed on another replica (which replays the delivered tokens first).

Grammars are compiled once per schema and kept (xgrammar's cache, bounded); the first
request with a new schema pays its compile time, which the replica spends on a worker
thread, never inside an engine step. JSON is generated compactly (no free whitespace): a
small model may otherwise fill its whole budget with blank lines.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from replica.checkpoints.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from replica.errors import InvalidRequestError
from replica.sampling.params import StructuredOutput

CACHE_LIMIT_BYTES = 256 * 2**20
MAX_CACHED_GRAMMARS = 256
ANY_OBJECT = '{"type": "object"}'
# A JSON string's character as xgrammar writes it: with a length bound, and without
_STRING_CHARACTERS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
# What JSON allows: no raw control character (json.loads refuses them) and no surrogate
# (xgrammar's UTF-8 reader takes ED A0 80 as U+D800; a client decodes it as three U+FFFD)
_JSON_CHARACTER = r"[^\0-\x1f\"\\\r\n\ud800-\udfff]"
# xgrammar's errors start with a time and its own source position; the client gets the rest
_SOURCE_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


def grammar_vocabulary(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[Any], bool]:
    """Every token id's text as xgrammar reads it, special tokens as empty (never text), and
    whether the texts are byte-level BPE strings (else raw bytes)."""
    if isinstance(tokenizer, ByteTokenizer):
        return [bytes([i]) for i in range(256)] + [""] * (vocab_size - 256), False
    if isinstance(tokenizer, HFTokenizer):
        hf = tokenizer.hf
        tokens = hf.convert_ids_to_tokens(list(range(len(hf))))
        special = set(hf.all_special_ids) | set(hf.get_added_vocab().values())
        texts = ["" if i in special else t for i, t in enumerate(tokens)]
        return texts + [""] * (vocab_size - len(texts)), True
    raise TypeError(f"no grammar vocabulary for {type(tokenizer).__name__}")


class Grammars:
    """One engine's grammar compiler, built on first use (the tokenizer is loaded then)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer  # a Tokenizer, or a function that loads one
        self._vocab_size = vocab_size
        self._stops = list(stop_token_ids)
        self._compiler: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _ready(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                tokenizer = self._tokenizer() if callable(self._tokenizer) else self._tokenizer
                texts, byte_level = grammar_vocabulary(tokenizer, self._vocab_size)
                kind = xgrammar.VocabType.BYTE_LEVEL if byte_level else xgrammar.VocabType.RAW
                info = xgrammar.TokenizerInfo(
                    texts, kind, vocab_size=self._vocab_size, stop_token_ids=self._stops
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES
                )
            return self._compiler

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar (cached); ``InvalidRequestError`` naming what is wrong."""
        key = spec.schema_text or spec.kind
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> Any:
        import xgrammar

        compiler = self._ready()
        try:
            schema = spec.schema_text or ANY_OBJECT  # json_object: any object, not any JSON
            grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
            ebnf = str(grammar)
            for lax in _STRING_CHARACTERS:
                ebnf = ebnf.replace(lax, _JSON_CHARACTER)
            return compiler.compile_grammar(xgrammar.Grammar.from_ebnf(ebnf))
        except (RuntimeError, ValueError) as exc:
            message = _SOURCE_PREFIX.sub("", str(exc)).strip().splitlines()[0]
            raise InvalidRequestError(
                f"the JSON schema is not supported: {message}",
                param="response_format",
                code="invalid_schema",
            ) from None

    def state(self, spec: StructuredOutput, vocab_size: int) -> GrammarState:
        return GrammarState(self.compile(spec), vocab_size)


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.compiled = compiled
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ([vocab], float32) with every token the grammar forbids at -inf (a
        copy)."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        out = logits.unsqueeze(0).clone()
        self._xgr.apply_token_bitmask_inplace(out, self._bitmask, vocab_size=self.vocab_size)
        return out[0]

    def accept(self, token_id: int) -> None:
        """Advance past a committed token (one the mask allowed, or one this grammar produced
        on another replica)."""
        if not self.matcher.accept_token(token_id):
            raise InvalidRequestError(
                f"token {token_id} does not continue the requested format", param="response_format"
            )

    def fresh(self) -> GrammarState:
        """The same grammar from its start (for another choice of the request)."""
        return GrammarState(self.compiled, self.vocab_size)

    @property
    def complete(self) -> bool:
        """The grammar ended (its end token accepted): nothing may follow."""
        return bool(self.matcher.is_terminated())

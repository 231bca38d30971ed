"""Next-token choice per request: greedy, or temperature and top-p, resumable anywhere.

A sampled token depends only on the request's seed, its position among the request's
output tokens, and the logits: each draw uses a generator seeded with
``BLAKE2b(seed, position)``. So a request produces the same tokens alone or in any batch,
after any number of earlier steps, and on any replica: a stream resumed on another replica
after its replica died continues exactly where it left off. The seed is ``params.seed``
(any integer, taken modulo 2**63); without one, the engine seed and the request id (the
ingress always assigns a seed, so its resumes reproduce). Logits are first processed by the
request's parameters (``replica.sampling.logits_processing``), after the grammar's mask for a
request held to a format (``replica.sampling.grammar``); logprobs come from the raw logits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from replica.sampling.grammar import GrammarState
from replica.sampling.logits_processing import needs_processing, process_logits
from replica.sampling.params import SamplingParams, TokenLogprob

# Below this temperature, sampling is greedy: dividing by it would overflow the logits.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SampleRow:
    """What sampling one row needs of its request (the engine builds one per sampled row):
    its id and parameters, its tokens (``token_ids``: the prompt's ``num_prompt_tokens``,
    then the output so far; the list is the request's own, read, never changed) and its
    grammar's state, if it is held to a format."""

    request_id: str
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    grammar: GrammarState | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def position(self) -> int:
        """Which output token this draw is (its seed's position)."""
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: TokenLogprob | None = None  # set when the request asked for logprobs


def _plain_greedy(row: SampleRow) -> bool:
    p = row.params
    plain = p.temperature < MIN_TEMPERATURE and p.logprobs is None and not needs_processing(p)
    return plain and row.grammar is None


def position_seed(seed: int, position: int) -> int:
    """The generator seed of one draw: a stable mix of the request seed and the position."""
    data = f"{seed % 2**63}/{position}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def token_logprobs(logits: torch.Tensor, tokens: Iterable[int], top: int) -> list[TokenLogprob]:
    """Each row's log-softmax at its token, with the ``top`` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.topk(top, dim=-1) if top else None
    out = []
    for row, token in enumerate(tokens):
        alternatives: tuple[tuple[int, float], ...] = ()
        if best is not None:
            ids, values = best.indices[row].tolist(), best.values[row].tolist()
            alternatives = tuple(zip(ids, values, strict=True))
        out.append(TokenLogprob(int(token), float(logprobs[row, token]), alternatives))
    return out


class Sampler:
    def __init__(self, seed: int, end_token_ids: Iterable[int] = ()) -> None:
        self.seed = seed
        self.end_token_ids = tuple(end_token_ids)  # what min_tokens holds back

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[Sample]:
        """``logits``: [len(rows), vocab], float32. One sample per row: the token at its
        request's output position ``row.position``."""
        greedy = logits.argmax(dim=-1).tolist()  # one call for the plain greedy rows
        return [
            Sample(greedy[i]) if _plain_greedy(row) else self.sample_one(logits[i], row)
            for i, row in enumerate(rows)
        ]

    def sample_each(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[Sample | Exception]:
        """``sample``, but a row whose sampling raises gets its exception instead of a
        sample (the others are then sampled one by one: the same draws, as every draw is
        seeded by its own request and position)."""
        try:
            return list(self.sample(logits, rows))
        except Exception:
            out: list[Sample | Exception] = []
            for logit_row, row in zip(logits, rows, strict=True):
                try:
                    out += self.sample(logit_row.unsqueeze(0), [row])
                except Exception as exc:
                    out.append(exc)
            return out

    def sample_one(self, logits: torch.Tensor, row: SampleRow) -> Sample:
        params = row.params
        processed = logits if row.grammar is None else row.grammar.mask(logits)
        if needs_processing(params):
            processed = process_logits(
                processed, params, row.prompt_ids, row.output_ids, self.end_token_ids
            )
        if params.temperature >= MIN_TEMPERATURE:
            token = self._draw(processed, row)
        else:
            token = int(processed.argmax())
        if params.logprobs is None:
            return Sample(token)
        (logprob,) = token_logprobs(logits.unsqueeze(0), [token], params.logprobs)
        return Sample(token, logprob)

    def request_seed(self, row: SampleRow) -> int:
        if row.params.seed is not None:
            return row.params.seed
        digest = hashlib.blake2b(f"{self.seed}/{row.request_id}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") >> 1

    def _draw(self, logits: torch.Tensor, row: SampleRow) -> int:
        seed = position_seed(self.request_seed(row), row.position)
        gen = torch.Generator().manual_seed(seed)
        probs = torch.softmax(logits / row.params.temperature, dim=-1)
        if row.params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest head whose mass reaches top_p (the top token always stays)
            drop = sorted_probs.cumsum(0) - sorted_probs >= row.params.top_p
            drop[0] = False  # rounding can make the top token's own mass look "above" top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen))

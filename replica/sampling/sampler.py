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

from replica.engine.sequence import Sequence
from replica.messages import TokenLogprob
from replica.sampling.logits_processing import needs_processing, process_logits

# Below this temperature, sampling is greedy: dividing by it would overflow the logits.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: TokenLogprob | None = None  # set when the request asked for logprobs


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    plain = p.temperature < MIN_TEMPERATURE and p.logprobs is None and not needs_processing(p)
    return plain and seq.grammar is None


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


def record_prompt_logprobs(seq: Sequence, rows: torch.Tensor, num_new: int) -> None:
    """Keep the log-probabilities of the prompt tokens that a chunk's logits rows predict
    (row j predicts token ``first + j + 1``), when the request asked for them."""
    top = seq.params.prompt_logprobs
    first = seq.num_computed_tokens
    if top is None or first >= seq.num_prompt_tokens:
        return
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]  # the first prompt token has no context to predict it
    targets = seq.token_ids[first + 1 : min(first + num_new + 1, seq.num_prompt_tokens)]
    seq.prompt_logprobs += token_logprobs(rows[: len(targets)], targets, top)


class Sampler:
    def __init__(self, seed: int, end_token_ids: Iterable[int] = ()) -> None:
        self.seed = seed
        self.end_token_ids = tuple(end_token_ids)  # what min_tokens holds back

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sample]:
        """``logits``: [len(seqs), vocab], float32. One sample per sequence: the token at
        position ``seq.num_output_tokens`` of its output."""
        greedy = logits.argmax(dim=-1).tolist()  # one call for the plain greedy rows
        return [
            Sample(greedy[row]) if _plain_greedy(seq) else self.sample_one(logits[row], seq)
            for row, seq in enumerate(seqs)
        ]

    def sample_each(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sample | Exception]:
        """``sample``, but a sequence whose sampling raises gets its exception instead of a
        sample (the others are then sampled one by one: the same draws, as every draw is
        seeded by its own request and position)."""
        try:
            return list(self.sample(logits, seqs))
        except Exception:
            out: list[Sample | Exception] = []
            for row, seq in zip(logits, seqs, strict=True):
                try:
                    out += self.sample(row.unsqueeze(0), [seq])
                except Exception as exc:
                    out.append(exc)
            return out

    def sample_one(self, logits: torch.Tensor, seq: Sequence) -> Sample:
        params = seq.params
        processed = logits if seq.grammar is None else seq.grammar.mask(logits)
        if needs_processing(params):
            prompt, output = seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids
            processed = process_logits(processed, params, prompt, output, self.end_token_ids)
        if params.temperature >= MIN_TEMPERATURE:
            token = self._draw(processed, seq)
        else:
            token = int(processed.argmax())
        if params.logprobs is None:
            return Sample(token)
        (logprob,) = token_logprobs(logits.unsqueeze(0), [token], params.logprobs)
        return Sample(token, logprob)

    def request_seed(self, seq: Sequence) -> int:
        if seq.params.seed is not None:
            return seq.params.seed
        digest = hashlib.blake2b(f"{self.seed}/{seq.request_id}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") >> 1

    def _draw(self, logits: torch.Tensor, seq: Sequence) -> int:
        seed = position_seed(self.request_seed(seq), seq.num_output_tokens)
        gen = torch.Generator().manual_seed(seed)
        probs = torch.softmax(logits / seq.params.temperature, dim=-1)
        if seq.params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest head whose mass reaches top_p (the top token always stays)
            drop = sorted_probs.cumsum(0) - sorted_probs >= seq.params.top_p
            drop[0] = False  # rounding can make the top token's own mass look "above" top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen))

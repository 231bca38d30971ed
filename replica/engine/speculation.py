"""Verification of a sequence's drafts: keep a drafted token only where plain decoding
would have produced it.

The step computed the sequence's last token followed by its drafts ``d1..dk``, so logits
row ``j`` predicts the token after ``dj`` (row 0: after the last token). Row ``j`` is bitwise
the row plain decoding would compute at that position as long as ``d1..dj`` are the tokens
plain decoding chose, because the kernels give a position's logits independently of what
else the step computes (``replica.model.attention``, the invariance tests). So the rows are
sampled in order, each exactly as plain decoding samples (the request's seeded draw at
that output position, its penalties, grammar mask and logprobs, with the tokens before
it committed), and verification stops at the first sampled token that differs from its
draft: that token is the one plain decoding picks there. Every token kept is therefore
the token, and the logprob, of decoding without drafts; a step yields the accepted drafts
plus one.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

import torch

from replica.engine.sequence import Sequence
from replica.sampling.sampler import Sample, Sampler


@dataclass(frozen=True)
class Verified:
    """What one sequence's step yielded: its samples, committed in order, and how many of
    its drafts they confirmed (``samples`` holds one more unless it finished on a draft).
    Each sample came from a row whose position holds a token decoding chose (the last
    token's, then the confirmed drafts'), so the sequence's computed tokens grow by
    ``len(samples)``."""

    samples: list[Sample]
    accepted: int


def verify(
    seq: Sequence, rows: torch.Tensor, drafts: list[int], sampler: Sampler, eos: Set[int]
) -> Verified:
    """Sample ``rows`` ([1 + len(drafts), vocab]) in order, committing each token to
    ``seq`` (``Sequence.commit``: grammar, stop, ``max_tokens``), until one differs from
    its draft, the drafts run out, or the sequence finishes. A sampling error propagates
    (the engine fails the request)."""
    samples: list[Sample] = []
    for j in range(len(drafts) + 1):
        (sample,) = sampler.sample(rows[j : j + 1], [seq.sample_row()])
        samples.append(sample)
        seq.finish_reason = seq.commit(sample.token_id, eos)
        matched = j < len(drafts) and sample.token_id == drafts[j]
        if not matched or seq.finish_reason is not None:
            return Verified(samples, j + int(matched))
    raise AssertionError("unreachable: the last row has no draft to match")

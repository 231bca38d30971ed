"""Next-token choice per request: greedy, or temperature and top-p, resumable anywhere.

A sampled token depends only on the request's seed, its position among the request's
output tokens, and the logits: each draw uses a generator seeded with
``BLAKE2b(seed, position)``. So a request produces the same tokens alone or in any batch,
after any number of earlier steps, and on any replica: a stream resumed on another replica
after its replica died continues exactly where it left off. The seed is ``params.seed``
(any integer, taken modulo 2**63); without one, the engine seed and the request id (the
ingress always assigns a seed, so its resumes reproduce).
"""

from __future__ import annotations

import hashlib

import torch

from replica.sequence import Sequence

# Below this temperature, sampling is greedy: dividing by it would overflow the logits.
MIN_TEMPERATURE = 1e-5


def position_seed(seed: int, position: int) -> int:
    """The generator seed of one draw: a stable mix of the request seed and the position."""
    data = f"{seed % 2**63}/{position}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class Sampler:
    def __init__(self, seed: int) -> None:
        self.seed = seed

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """``logits``: [len(seqs), vocab], float32. Returns one token per sequence, the one
        at position ``seq.num_output_tokens`` of its output."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if seq.params.temperature >= MIN_TEMPERATURE:
                tokens[row] = self._draw(logits[row], seq)
        return tokens

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

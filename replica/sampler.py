"""Next-token choice per request: greedy, or temperature and top-p with a per-request RNG."""

from __future__ import annotations

import hashlib

import torch

from replica.sequence import Sequence

# Below this temperature, sampling is greedy: dividing by it would overflow the logits.
MIN_TEMPERATURE = 1e-5


class Sampler:
    """Each sampled request draws from its own generator, seeded by ``params.seed`` (any
    integer, taken modulo 2**63) or else by the engine seed and the request id, so its
    tokens do not depend on batch neighbours."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """``logits``: [len(seqs), vocab], float32. Returns one token per sequence."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if seq.params.temperature >= MIN_TEMPERATURE:
                tokens[row] = self._draw(logits[row], seq)
        return tokens

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _draw(self, logits: torch.Tensor, seq: Sequence) -> int:
        gen = self._generators.get(seq.request_id)
        if gen is None:
            seed = seq.params.seed
            if seed is None:
                digest = hashlib.blake2b(f"{self.seed}/{seq.request_id}".encode(), digest_size=8)
                seed = int.from_bytes(digest.digest(), "little") >> 1
            gen = torch.Generator().manual_seed(seed % 2**63)
            self._generators[seq.request_id] = gen
        probs = torch.softmax(logits / seq.params.temperature, dim=-1)
        if seq.params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest head whose mass reaches top_p (the top token always stays)
            drop = sorted_probs.cumsum(0) - sorted_probs >= seq.params.top_p
            drop[0] = False  # rounding can make the top token's own mass look "above" top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen))

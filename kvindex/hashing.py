"""Block hashing: the one function that engine, router and index share.

Block ``i`` of a token sequence covers tokens ``[i*B, (i+1)*B)``; only full blocks have a hash.
The hashes form a chain::

    h_{-1} = H(namespace)                       namespace = scheme, block size, model, cache_salt
    h_i    = H(h_{i-1} || tokens of block i)     tokens as little-endian uint32

so a block's hash means "the sequence that got here", never "these B tokens". ``H`` is
BLAKE2b with a 16-byte digest: stable across processes and machines (never Python's
``hash()``). With a cluster secret, ``H`` is BLAKE2b keyed with it, so a shared index of hashes
does not let anyone confirm "is this prompt cached?" by hashing a guess.

This module imports nothing heavy (no torch), so the router and the index can use it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

DIGEST_SIZE = 16
_SCHEME = b"prefix-serve/block-hash/v1"
_MAX_KEY_BYTES = 64  # BLAKE2b key limit


def _digest(data: bytes, key: bytes) -> bytes:
    """The hash primitive ``H``. Tests replace it with a weak hash to force collisions."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, key=key).digest()


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


@dataclass(frozen=True)
class BlockHasher:
    """Computes block hash chains for one model and block size.

    ``secret`` (optional, up to 64 bytes) keys every digest; a cluster must use one secret
    everywhere or nothing matches. ``model_id`` is part of the root, so two models never share.
    """

    block_size: int
    model_id: str
    secret: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if len(self.secret) > _MAX_KEY_BYTES:
            raise ValueError(f"secret must be at most {_MAX_KEY_BYTES} bytes")

    def root(self, cache_salt: str | None = None) -> bytes:
        """``h_{-1}``: the namespace of a chain. Different salts give unrelated chains."""
        salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode()
        data = b"\x00".join((_SCHEME, str(self.block_size).encode(), self.model_id.encode(), salt))
        return _digest(data, self.secret)

    def hash_block(self, parent: bytes, block_tokens: Sequence[int]) -> bytes:
        """``h_i`` from ``h_{i-1}`` and the ``block_size`` tokens of block ``i``."""
        if len(block_tokens) != self.block_size:
            raise ValueError("only full blocks have a hash")
        return self.chain(block_tokens, parent=parent)[0]

    def affinity_key(
        self,
        token_ids: Sequence[int],
        num_blocks: int,
        cache_salt: str | None = None,
        chain: Sequence[bytes] | None = None,
    ) -> bytes:
        """The routing key of a prompt: the hash of its first ``num_blocks`` full blocks.

        ``chain`` may pass the prompt's chain if the caller has it. A prompt shorter than one
        block uses what it has: a digest of its partial block under the same root.
        """
        if len(token_ids) >= self.block_size:
            if chain is None:
                chain = self.chain(token_ids[: num_blocks * self.block_size], cache_salt)
            return chain[min(num_blocks, len(chain)) - 1]
        partial = b"partial" + _encode_tokens(token_ids)
        return _digest(self.root(cache_salt) + partial, self.secret)

    def chain(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        *,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[bytes]:
        """Hashes of the full blocks of ``token_ids`` from ``start_block`` on.

        ``parent`` is the hash of block ``start_block - 1`` (the root when starting at 0), so a
        chain can be extended as a sequence grows without rehashing what it already has.
        """
        bs = self.block_size
        prev = self.root(cache_salt) if parent is None else parent
        n_full = len(token_ids) // bs
        encoded = _encode_tokens(token_ids[start_block * bs : n_full * bs])
        width = 4 * bs
        hashes = []
        for offset in range(0, len(encoded), width):
            prev = _digest(prev + encoded[offset : offset + width], self.secret)
            hashes.append(prev)
        return hashes


def id_hash(name: str | bytes) -> int:
    """A name's 64-bit hash (a replica id, a routing key) for rendezvous ranking
    (``router.policies.rendezvous_weights``): BLAKE2b, stable across processes."""
    data = name.encode() if isinstance(name, str) else name
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

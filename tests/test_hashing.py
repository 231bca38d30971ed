"""The block hash chain: stable, cumulative, namespaced, keyed."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvindex.hashing import BlockHasher

TOKENS = list(range(1000, 1040))  # 2 full blocks of 16 and 8 tokens left over


def test_chain_matches_the_documented_construction() -> None:
    hasher = BlockHasher(16, "m")
    root = hashlib.blake2b(b"prefix-serve/block-hash/v1\x0016\x00m\x00", digest_size=16).digest()
    h0 = hashlib.blake2b(root + struct.pack("<16I", *TOKENS[:16]), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + struct.pack("<16I", *TOKENS[16:32]), digest_size=16).digest()
    assert hasher.root() == root
    assert hasher.chain(TOKENS) == [h0, h1]
    assert hasher.hash_block(h0, TOKENS[16:32]) == h1


def test_chain_is_stable_across_processes() -> None:
    code = (
        "from kvindex.hashing import BlockHasher;"
        "print(BlockHasher(16, 'm').chain(list(range(1000, 1040)))[-1].hex())"
    )
    for seed in ("0", "1"):  # Python's own hash() would differ between these
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).parent.parent,
        )
        assert out.stdout.strip() == BlockHasher(16, "m").chain(TOKENS)[-1].hex()


def test_only_full_blocks_and_prefixes_share_hashes() -> None:
    hasher = BlockHasher(16, "m")
    full = hasher.chain(TOKENS)
    assert len(full) == 2
    assert hasher.chain(TOKENS[:31]) == full[:1]
    assert hasher.chain(TOKENS + [5] * 24)[:2] == full
    changed = [*TOKENS[:5], 7, *TOKENS[6:]]
    assert hasher.chain(changed)[1] != full[1]  # a change anywhere before alters later blocks
    with pytest.raises(ValueError):
        hasher.hash_block(full[0], TOKENS[:15])


def test_extending_a_chain_equals_hashing_it_whole() -> None:
    hasher = BlockHasher(16, "m")
    longer = TOKENS + list(range(24))
    head = hasher.chain(longer[:20])
    assert head + hasher.chain(longer, parent=head[-1], start_block=1) == hasher.chain(longer)


def test_namespace_salt_model_block_size_and_secret_each_change_every_hash() -> None:
    base = BlockHasher(16, "m").chain(TOKENS)
    variants = [
        BlockHasher(16, "m").chain(TOKENS, cache_salt="tenant"),
        BlockHasher(16, "m").chain(TOKENS, cache_salt=""),
        BlockHasher(16, "other-model").chain(TOKENS),
        BlockHasher(16, "m", secret=b"cluster-secret").chain(TOKENS),
    ]
    for v in variants:
        assert set(v).isdisjoint(base)
    assert BlockHasher(8, "m").chain(TOKENS)[1] != base[0]


def test_bad_tokens_and_secrets_are_rejected() -> None:
    hasher = BlockHasher(4, "m")
    with pytest.raises(ValueError):
        hasher.chain([1, 2, 3, -1])
    with pytest.raises(ValueError):
        hasher.chain([1, 2, 3, 2**32])
    with pytest.raises(ValueError):
        BlockHasher(4, "m", secret=b"x" * 65)
    with pytest.raises(ValueError):
        BlockHasher(0, "m")

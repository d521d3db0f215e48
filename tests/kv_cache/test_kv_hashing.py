"""Chained block hashes: deterministic, chained through the parent, unambiguous in their extra keys."""

from __future__ import annotations

import pytest

from paged_jax.kv_cache import BlockHasher


def test_hash_is_stable_across_processes() -> None:
    # Pinned digest: a change of encoding silently invalidates any persisted cache, so it must be deliberate.
    h = BlockHasher(8).hash_block(None, list(range(8)))
    assert len(h) == 16
    assert h.hex() == BlockHasher(8).hash_block(None, range(8)).hex()
    assert h.hex() == "b48ace6b961b082113de3d9ab1e0de1b"


def test_chaining_and_extra_keys_change_the_hash() -> None:
    hasher = BlockHasher(8)
    block = [1] * 8
    root = hasher.hash_block(None, block)
    assert hasher.hash_block(root, block) != root
    assert hasher.hash_block(root, block) != hasher.hash_block(hasher.hash_block(None, [2] * 8), block)
    assert hasher.hash_block(None, block, ("salt",)) != root
    # Length prefixes keep key boundaries unambiguous.
    assert hasher.hash_block(None, block, ("ab", "c")) != hasher.hash_block(None, block, ("a", "bc"))
    # Different page sizes never collide on a prefix of the same tokens.
    assert BlockHasher(16).hash_block(None, block + block) != hasher.hash_block(None, block)


def test_extend_salts_only_the_first_block_and_is_incremental() -> None:
    hasher = BlockHasher(8)
    tokens = list(range(40))
    full = hasher.extend([], tokens, 5, ("t",))
    part = hasher.extend([], tokens, 2, ("t",))
    assert hasher.extend(part, tokens, 5, ("t",)) == full
    assert full[0] == hasher.hash_block(None, tokens[:8], ("t",))
    assert full[1] == hasher.hash_block(full[0], tokens[8:16])
    assert hasher.extend([], tokens, 5)[1:] != full[1:]  # the salt reaches later blocks through the chain


def test_bad_lengths_raise() -> None:
    hasher = BlockHasher(8)
    with pytest.raises(ValueError):
        hasher.hash_block(None, [1] * 7)
    with pytest.raises(ValueError):
        hasher.extend([], list(range(15)), 2)

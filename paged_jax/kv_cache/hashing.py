"""Chained block hashes for the prefix cache.

A full block of ``page_size`` tokens is identified by ``hash(parent_hash, block_token_ids, extra_keys)``:
the parent hash makes the hash name the whole prefix up to and including the block, so two requests share
a page only when every earlier token matches too. ``extra_keys`` carries anything else that changes the
KV of the same tokens (a per-tenant cache salt, a LoRA adapter's digest), given for the first block.

The hash is xxh3-128 over a canonical, unambiguous byte encoding (tag bytes and length prefixes, tokens as
little-endian int64). Python's ``hash()`` of a tuple is randomized per process for strings and far too
collision-prone for a cache whose false hit silently serves another prompt's KV.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", bytes)
"""16-byte digest naming a full block together with its whole prefix and extra keys."""
HASH_BYTES = 16

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"
_U32 = struct.Struct("<I")


class BlockHasher:
    """Hashes full blocks of one fixed ``page_size``; the token packer is compiled once."""

    __slots__ = ("page_size", "_pack_tokens", "_header")

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._pack_tokens = struct.Struct(f"<{page_size}q").pack
        self._header = _U32.pack(page_size)

    def hash_block(
        self, parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()
    ) -> BlockHash:
        """Hash one full block; ``token_ids`` must hold exactly ``page_size`` ids (int64 range)."""
        if len(token_ids) != self.page_size:
            raise ValueError(f"a block holds {self.page_size} tokens, got {len(token_ids)}")
        parts = [_HAS_PARENT + parent if parent is not None else _NO_PARENT, self._header]
        parts.append(self._pack_tokens(*token_ids))
        parts.append(_U32.pack(len(extra_keys)))
        for key in extra_keys:
            raw = key.encode("utf-8")
            parts.append(_U32.pack(len(raw)))
            parts.append(raw)
        return BlockHash(xxhash.xxh3_128_digest(b"".join(parts)))

    def extend(
        self,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        num_blocks: int,
        extra_keys: tuple[str, ...] = (),
    ) -> list[BlockHash]:
        """Append to ``hashes`` (in place) the chained hashes of blocks ``len(hashes)..num_blocks-1``.

        ``extra_keys`` (salt, adapter) go into the first block's hash only: through the chain they then separate
        every later block as well, at no extra cost per block.
        """
        ps = self.page_size
        if num_blocks * ps > len(token_ids):
            raise ValueError(f"{num_blocks} full blocks need {num_blocks * ps} tokens, got {len(token_ids)}")
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = self.hash_block(parent, token_ids[i * ps : (i + 1) * ps], extra_keys if i == 0 else ())
            hashes.append(parent)
        return hashes

"""Chained, collision-resistant hashes of full blocks.

hash(block i) = sha256(hash(block i-1) || token ids of block i), where the
chain starts from a root hash of the extra keys (model/adapter id and the
request's cache_salt). Because every block hash covers its parent, equal
hashes mean equal whole prefixes, and the extra keys reach every block.

sha256 (rather than Python's hash()) makes a collision practically impossible,
so a hit is trusted without comparing token ids: that keeps token copies out
of the pool and keeps the hit path free of per-token work.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT_TAG = b"kvserve.kvcache.v1\x00"


def _length_prefixed(text: str) -> bytes:
    # A length prefix keeps ("ab", "c") and ("a", "bc") apart.
    raw = text.encode("utf-8")
    return len(raw).to_bytes(8, "little") + raw


def root_hash(model_key: str, cache_salt: str | None, adapter: str | None = None) -> bytes:
    """Parent hash of a request's first block, from its extra keys (adapter: the
    LoRA adapter its KV is computed under, None for the base model)."""
    # The marker bytes keep None apart from "".
    salt = b"\x00" if cache_salt is None else b"\x01" + _length_prefixed(cache_salt)
    lora = b"" if adapter is None else b"\x02" + _length_prefixed(adapter)
    return hashlib.sha256(_ROOT_TAG + _length_prefixed(model_key) + salt + lora).digest()


class BlockHasher:
    """Hashes full blocks of one fixed size."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # A precompiled fixed-width encoding is the fastest stable one we have
        # (about 2x array('q').tobytes()); every full block has block_size ids.
        self._pack = struct.Struct(f"<{block_size}q").pack

    def hash_block(self, parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
        """Hash of a full block given its parent's hash (32 bytes, fixed width)."""
        return hashlib.sha256(parent_hash + self._pack(*token_ids)).digest()

    def hash_blocks(
        self, parent_hash: bytes, token_ids: Sequence[int], first: int, stop: int
    ) -> list[bytes]:
        """Chained hashes of full blocks first..stop-1, same values as calling
        hash_block on each. Encodes the whole range with one pack and slices
        the bytes: this runs for every block a prefill fills."""
        bs = self.block_size
        count = (stop - first) * bs
        if count <= 0:
            return []
        start = first * bs
        raw = struct.pack(f"<{count}q", *token_ids[start : start + count])
        width = 8 * bs
        sha256 = hashlib.sha256
        out = []
        for offset in range(0, len(raw), width):
            parent_hash = sha256(parent_hash + raw[offset : offset + width]).digest()
            out.append(parent_hash)
        return out

"""The second KV tier as the block pool sees it: somewhere beyond the KV cache
(host memory, local disk) that keeps the prefix blocks the pool evicts, found
again by the same chained hashes, so a prompt whose history was evicted loads it
back instead of recomputing it.

The engine implements it (engine/kv_offload/), since it moves the KV itself; this
side only names blocks and hashes. save() and load() queue copies the runner makes
in order before the next step's forward pass: a block evicted now is written by
that step at the earliest, and a block loaded now is read by it at the earliest."""

from __future__ import annotations

from typing import Protocol


class SecondTier(Protocol):
    def save(self, block_id: int, block_hash: bytes) -> None:
        """Block `block_id`, about to be reused, holds the KV of `block_hash`: keep a
        copy (taken before the next step writes the block)."""

    def find(self, block_hash: bytes) -> bool:
        """Whether the tier holds `block_hash` whole and sound (a copy that fails
        its checksum is dropped here, and the block is computed again)."""

    def load(self, block_hash: bytes, block_id: int) -> None:
        """Fill block `block_id` with `block_hash`'s KV (found just before) before
        the next step reads it."""

    def clear(self) -> None:
        """Forget everything held (the prefix cache was reset)."""

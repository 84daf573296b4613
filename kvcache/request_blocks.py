"""Per-request block table and the hash chain of its full blocks."""

from __future__ import annotations

# What a dropped block's entry holds: any valid block index would do (the window
# masks what it holds; the caches start zeroed, so it is finite), 0 always is one.
DROPPED_BLOCK = 0


class RequestBlocks:
    """What the manager remembers about one request."""

    __slots__ = ("block_ids", "hashes", "root_hash", "num_tokens", "num_dropped")

    def __init__(
        self,
        root_hash: bytes,
        block_ids: list[int] | None = None,
        hashes: list[bytes] | None = None,
        num_tokens: int = 0,
        num_dropped: int = 0,
    ) -> None:
        # Logical block i -> physical block id; grows only as tokens arrive.
        self.block_ids = block_ids if block_ids is not None else []
        # Chained hashes of logical blocks 0..len-1, all of them full. Kept per
        # request (not read back from the blocks) because a full block may be
        # left unregistered when another block already caches the same prefix.
        self.hashes = hashes if hashes is not None else []
        # Parent hash of block 0: encodes the model key and the cache_salt.
        self.root_hash = root_hash
        # Tokens whose KV the table holds (what a copy-on-write must preserve).
        self.num_tokens = num_tokens
        # Leading blocks let go of because every layer's sliding window has passed
        # them: their entries hold DROPPED_BLOCK, a valid index whose contents no
        # query reads unmasked; the request holds no reference to it.
        self.num_dropped = num_dropped

    def clone(self) -> RequestBlocks:
        """Same blocks and hashes, independent lists (for fork)."""
        return RequestBlocks(
            self.root_hash, list(self.block_ids), list(self.hashes), self.num_tokens,
            self.num_dropped,
        )

    @property
    def held(self) -> list[int]:
        """The block ids the request holds a reference to."""
        return self.block_ids[self.num_dropped:]

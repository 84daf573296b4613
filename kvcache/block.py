"""One physical KV-cache block as the pool sees it.

The block object doubles as a node of the free queue (``prev``/``next``), so
taking a block out of the middle of the queue on a prefix hit is O(1) and needs
no search.
"""

from __future__ import annotations


class Block:
    """Bookkeeping for one fixed-size slot range of the device KV cache."""

    # __slots__ keeps tens of thousands of blocks small and attribute access fast.
    __slots__ = ("block_id", "ref_count", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Number of request block tables that hold this block right now.
        self.ref_count = 0
        # Chained hash of the block's full contents while it is registered in
        # the pool's hash -> block map; None for partial or unregistered blocks.
        self.block_hash: bytes | None = None
        # Free-queue links; both None while the block is not in the queue.
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "plain"
        return f"Block(id={self.block_id}, ref={self.ref_count}, {cached})"

"""The pool of physical blocks: ref counts, free LRU queue, hash -> block map.

Invariants (checked by the tests):
* a block is in the free queue exactly when its ref_count is 0;
* ``block.block_hash is not None`` exactly when ``cached[block.block_hash] is block``.
"""

from __future__ import annotations

from collections.abc import Iterable

from .block import Block
from .free_queue import FreeBlockQueue
from .records import CacheStats


class BlockPool:
    """Hands out, shares, frees and evicts fixed-size blocks."""

    def __init__(self, num_blocks: int, stats: CacheStats) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # One block per hash: a second block that fills with an already cached
        # prefix (two requests computing it concurrently) simply stays unregistered.
        self.cached: dict[bytes, Block] = {}
        self._stats = stats

    @property
    def num_free(self) -> int:
        return self.free_queue.size

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` blocks from the head of the free queue (ref_count 1).

        A taken block loses its cached hash only now, so freed blocks stay
        hittable for as long as possible.
        """
        if count > self.free_queue.size:
            raise ValueError(f"asked for {count} blocks, {self.free_queue.size} free")
        taken = self.free_queue.popleft_n(count)
        for block in taken:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
        return taken

    def _evict(self, block: Block) -> None:
        del self.cached[block.block_hash]
        block.block_hash = None
        self._stats.evictions += 1

    def touch(self, block: Block) -> None:
        """Add a reference; a free (cached) block leaves the free queue."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the order given.

        A block reaching zero keeps its hash and joins the tail (evicted last);
        a block with no hash has nothing worth keeping, so it goes to the head
        and is reused before any cached block is evicted.
        """
        queue = self.free_queue
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def register_all(self, blocks: Iterable[Block], hashes: Iterable[bytes]) -> None:
        """register() for just-filled blocks in bulk (one call per step)."""
        cached = self.cached
        for block, block_hash in zip(blocks, hashes):
            if block.block_hash is None and block_hash not in cached:
                cached[block_hash] = block
                block.block_hash = block_hash

    def unregister(self, block: Block) -> None:
        """Forget a held block's hash (its KV will never be written)."""
        del self.cached[block.block_hash]
        block.block_hash = None

    def register(self, block: Block, block_hash: bytes) -> bool:
        """Make a just-filled block hittable; False when the hash is taken."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        self.cached[block_hash] = block
        block.block_hash = block_hash
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refuses (False) while any block is in use.

        Refusing, like vLLM, keeps the rule simple: a running request's full
        blocks are registered too, and dropping only some of a live chain would
        leave half-cached prefixes behind.
        """
        if len(self.free_queue) != len(self.blocks):
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

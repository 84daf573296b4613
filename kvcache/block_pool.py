"""The pool of physical blocks: ref counts, free LRU queue, hash -> block map.

Invariants (checked by the tests):
* a block is in the free queue exactly when its ref_count is 0;
* ``block.block_hash is not None`` exactly when ``cached[block.block_hash] is block``.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence

from .block import Block
from .events import KVEventLog
from .free_queue import FreeBlockQueue
from .records import CacheStats
from .second_tier import SecondTier


class BlockPool:
    """Hands out, shares, frees and evicts fixed-size blocks."""

    def __init__(self, num_blocks: int, stats: CacheStats,
                 events: KVEventLog | None = None, tier: SecondTier | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # One block per hash: a second block that fills with an already cached
        # prefix (two requests computing it concurrently) simply stays unregistered.
        self.cached: dict[bytes, Block] = {}
        self.stats = stats
        self.events = events  # None: nobody listens, nothing recorded
        # Hashes registered without an event (a hybrid model's sliding-window layer
        # groups: their chains are kvserve's own bookkeeping, not prefixes a router
        # can place requests by), so their eviction is not announced either.
        self._unannounced: set[bytes] = set()
        # Where evicted prefix blocks go rather than being lost (None: lost).
        self.tier = tier

    @property
    def num_free(self) -> int:
        return self.free_queue.size

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request."""
        return 1.0 - self.free_queue.size / len(self.blocks)

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
        # Only eviction hands a block on: an unregistered block (uncache, free past
        # the computed tokens) holds KV nobody wrote.
        if self.tier is not None:
            self.tier.save(block.block_id, block.block_hash)
        self.unregister(block)
        self.stats.evictions += 1

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

    def register_all(self, blocks: Sequence[Block], hashes: Sequence[bytes],
                     parent: bytes | None = None, token_ids: Sequence[int] = (),
                     announce: bool = True) -> None:
        """Makes just-filled blocks hittable, in bulk (one call per step); a block
        whose hash another block holds stays unregistered. parent: the hash before
        hashes[0]; token_ids: the blocks' tokens (both for the events only);
        announce=False: no event now or at eviction."""
        cached = self.cached
        newly = []
        for i, (block, block_hash) in enumerate(zip(blocks, hashes)):
            if block.block_hash is None and block_hash not in cached:
                cached[block_hash] = block
                block.block_hash = block_hash
                newly.append(i)
        if self.events is not None and newly:
            if announce:
                self._record_stored(newly, hashes, parent, token_ids)
            else:
                self._unannounced.update(hashes[i] for i in newly)

    def _record_stored(self, newly: list[int], hashes: Sequence[bytes],
                       parent: bytes | None, token_ids: Sequence[int]) -> None:
        """One BlockStored per run of consecutive blocks registered."""
        size, start = self.events.block_size, 0
        for end in range(1, len(newly) + 1):
            if end == len(newly) or newly[end] != newly[end - 1] + 1:
                first, last = newly[start], newly[end - 1] + 1
                self.events.stored(hashes[first:last],
                                   hashes[first - 1] if first else parent,
                                   token_ids[first * size:last * size])
                start = end

    def register(self, block: Block, block_hash: bytes) -> bool:
        """Make a just-filled block hittable; False when the hash is taken."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        self.register_all([block], [block_hash])
        return True

    def unregister(self, block: Block) -> None:
        """Forget a block's hash (evicted, or its KV will never be written)."""
        del self.cached[block.block_hash]
        if self.events is not None and not _discarded(self._unannounced, block.block_hash):
            self.events.removed(block.block_hash)
        block.block_hash = None

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
        self._unannounced.clear()
        if self.tier is not None:
            self.tier.clear()
        if self.events is not None:
            self.events.cleared()
        return True


def _discarded(items: set[bytes], item: bytes) -> bool:
    """Removes item from items; whether it was there."""
    if item in items:
        items.discard(item)
        return True
    return False

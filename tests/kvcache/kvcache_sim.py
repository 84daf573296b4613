"""Test helpers: a fake device that stores token ids in block slots, and a
checker for the pool's structural invariants."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence

from kvserve.kvcache import BlockCopy, KVCacheManager


class FakeDevice:
    """block id -> slot contents. Freshly handed-out blocks hold garbage, so a
    missing copy or a write into someone else's block shows up on read-back."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._garbage = itertools.count(-1, -1)  # real tokens are >= 0
        self.slots = {b: self._junk() for b in range(num_blocks)}

    def _junk(self) -> list[int]:
        return [next(self._garbage) for _ in range(self.block_size)]

    def scramble(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.slots[block_id] = self._junk()

    def apply_copies(self, copies: Sequence[BlockCopy]) -> None:
        for c in copies:
            self.slots[c.dst][: c.num_tokens] = self.slots[c.src][: c.num_tokens]

    def write(self, table: Sequence[int], tokens: Sequence[int], start: int, end: int) -> None:
        bs = self.block_size
        for pos in range(start, end):
            self.slots[table[pos // bs]][pos % bs] = tokens[pos]

    def read(self, table: Sequence[int], num_tokens: int) -> list[int]:
        bs = self.block_size
        return [self.slots[table[pos // bs]][pos % bs] for pos in range(num_tokens)]


def check_pool_invariants(mgr: KVCacheManager, request_ids: Iterable[str]) -> None:
    """Ref counts match the tables, the free queue matches ref counts, and the
    hash map matches the blocks' own hashes."""
    pool = mgr._pool
    holders = Counter()
    for rid in request_ids:
        table = mgr.block_table(rid)
        assert len(set(table)) == len(table), f"{rid} holds a block twice: {table}"
        holders.update(table)
    for block in pool.blocks:
        assert block.ref_count == holders[block.block_id], block
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == len(pool.free_queue)
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_count == 0}
    assert mgr.num_free_blocks == len(free_ids)
    assert abs(mgr.usage - (1 - len(free_ids) / mgr.num_blocks)) < 1e-12
    _check_links(pool)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)


def _check_links(pool) -> None:
    node = pool.free_queue._head
    while node.next is not None:
        assert node.next.prev is node
        node = node.next
    assert node is pool.free_queue._tail
    for block in pool.blocks:
        in_queue = block.prev is not None
        assert in_queue == (block.ref_count == 0), block

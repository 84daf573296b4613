"""BlockPool: allocation order, eviction, touch/release, hash map upkeep."""

from kvserve.kvcache.block_pool import BlockPool
from kvserve.kvcache.records import CacheStats


def free_ids(pool):
    return [b.block_id for b in pool.free_queue]


def make(num_blocks=4):
    stats = CacheStats()
    return BlockPool(num_blocks, stats), stats


def test_allocate_takes_from_the_head():
    pool, _ = make()
    taken = pool.allocate(2)
    assert [b.block_id for b in taken] == [0, 1]
    assert all(b.ref_count == 1 for b in taken)
    assert pool.num_free == 2 and free_ids(pool) == [2, 3]


def test_cached_blocks_go_to_the_tail_plain_ones_to_the_head():
    pool, _ = make()
    a, b, c = pool.allocate(3)
    pool.register(a, b"h-a")
    pool.release([c, b, a])
    # b and c have nothing worth keeping: reused before cached a.
    assert free_ids(pool) == [b.block_id, c.block_id, 3, a.block_id]


def test_eviction_happens_on_reuse_and_is_counted():
    pool, stats = make(1)
    (block,) = pool.allocate(1)
    assert pool.register(block, b"h")
    pool.release([block])
    assert pool.lookup(b"h") is block and block.block_hash == b"h"
    assert stats.evictions == 0
    (again,) = pool.allocate(1)
    assert again is block and block.block_hash is None
    assert pool.lookup(b"h") is None and stats.evictions == 1


def test_touch_revives_a_free_cached_block():
    pool, stats = make(3)
    (block,) = pool.allocate(1)
    pool.register(block, b"h")
    pool.release([block])
    pool.touch(block)
    assert block.ref_count == 1 and block.block_id not in free_ids(pool)
    pool.touch(block)
    assert block.ref_count == 2
    pool.release([block])
    assert block.ref_count == 1 and pool.num_free == 2
    assert stats.evictions == 0


def test_one_block_per_hash():
    pool, _ = make()
    a, b = pool.allocate(2)
    assert pool.register(a, b"h")
    assert not pool.register(b, b"h")
    assert not pool.register(a, b"other")  # already registered under b"h"
    assert b.block_hash is None and pool.lookup(b"h") is a


def test_reset_refuses_while_blocks_are_in_use():
    pool, _ = make(2)
    a, b = pool.allocate(2)
    pool.register(a, b"h")
    pool.release([b])
    assert not pool.reset_prefix_cache()
    assert pool.lookup(b"h") is a
    pool.release([a])
    assert pool.reset_prefix_cache()
    assert pool.lookup(b"h") is None and a.block_hash is None

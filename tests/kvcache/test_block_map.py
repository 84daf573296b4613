"""The KV cache's block map (kvcache/block_map.py): each block's state, read off the
pool and the request tables, for the engine page."""
from __future__ import annotations

from kvserve.kvcache import KVCacheManager
from kvserve.kvcache.block_map import STATE_NAMES

BS = 4


def states(mgr: KVCacheManager) -> str:
    return mgr.block_states().decode("ascii")


def test_a_fresh_cache_is_all_free():
    assert states(KVCacheManager(6, BS)) == "000000"
    assert STATE_NAMES[0] == "free" and len(STATE_NAMES) == 5


def test_one_request_holds_its_blocks_and_its_freed_prefix_stays_cached():
    mgr = KVCacheManager(6, BS)
    assert mgr.allocate_slots("a", list(range(10)), 0, 10)  # 2 full blocks + 2 tokens
    assert states(mgr) == "222000"
    mgr.free("a")
    # The two full blocks are hashed: free but worth keeping (evicted last); the
    # partial one holds nothing reusable.
    assert states(mgr) == "110000"


def test_a_prefix_hit_shows_the_prefix_as_shared():
    mgr = KVCacheManager(8, BS)
    prompt = list(range(8))
    assert mgr.allocate_slots("a", prompt + [100, 101], 0, 10)
    hit = mgr.lookup_prefix("b", prompt + [200])
    assert hit == 8
    assert mgr.allocate_slots("b", prompt + [200], hit, 1)
    assert states(mgr) == "33220000"  # a's and b's third blocks are theirs alone


def test_a_fork_shares_its_partial_block_copy_on_write_until_written():
    mgr = KVCacheManager(6, BS)
    prompt = list(range(6))
    assert mgr.allocate_slots("p", prompt, 0, 6)
    mgr.fork("p", "c")
    assert states(mgr) == "340000"  # full block shared; the partial one will be copied
    assert mgr.allocate_slots("p", prompt + [7], 6, 1)  # the copy happens
    assert states(mgr) == "322000"


def test_the_map_covers_every_block_and_counts_add_up():
    mgr = KVCacheManager(32, BS)
    for i in range(5):
        assert mgr.allocate_slots(f"r{i}", list(range(i * 100, i * 100 + 9)), 0, 9)
    mgr.free("r0")
    got = mgr.block_states()
    assert len(got) == 32
    assert got.count(ord("2")) == 12 and got.count(ord("1")) == 2
    assert got.count(ord("0")) == 32 - 14

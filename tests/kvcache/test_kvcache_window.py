"""Sliding windows on every layer: blocks every window has passed go back to the pool
as a request grows (their entries hold DROPPED_BLOCK), and stay in the prefix cache
until evicted; forks, frees, the block map and prefix hits count only what a
request still holds."""

from kvserve.kvcache import KVCacheManager
from kvserve.kvcache.block_map import USED, block_states
from kvserve.kvcache.request_blocks import DROPPED_BLOCK

BS, WINDOW = 4, 6


def tokens(n, start=0):
    return list(range(start, start + n))


def decode(mgr, rid, seq, steps):
    """Grow `rid` a token a step as the scheduler does."""
    for _ in range(steps):
        seq.append(len(seq) + 1000)
        assert mgr.allocate_slots(rid, seq, len(seq) - 1, 1)


def test_a_growing_request_holds_only_the_blocks_its_window_reaches():
    mgr = KVCacheManager(16, BS, sliding_window=WINDOW)
    seq = tokens(8)
    assert mgr.allocate_slots("a", seq, 0, 8)
    decode(mgr, "a", seq, 40)  # 48 tokens: 12 blocks' worth
    table = mgr.block_table("a")
    assert len(table) == 12
    held = mgr._requests["a"].held
    # A query at 48 or later sees keys from 43 on: blocks 10 and 11 at least; a
    # block is let go of once it ends before num_computed - window.
    assert 2 <= len(held) <= (WINDOW + BS) // BS + 2
    assert table[:len(table) - len(held)] == [DROPPED_BLOCK] * (len(table) - len(held))
    assert mgr.num_free_blocks == 16 - len(held)
    assert mgr.stats.window_dropped == 12 - len(held)
    mgr.free("a")
    assert mgr.num_free_blocks == 16


def test_without_a_window_every_block_is_kept():
    mgr = KVCacheManager(16, BS)
    seq = tokens(8)
    assert mgr.allocate_slots("a", seq, 0, 8)
    decode(mgr, "a", seq, 40)
    assert mgr.num_free_blocks == 4 and mgr.stats.window_dropped == 0


def test_a_long_request_fits_a_cache_smaller_than_its_context():
    mgr = KVCacheManager(5, BS, sliding_window=WINDOW)
    seq = tokens(4)
    assert mgr.allocate_slots("a", seq, 0, 4)
    decode(mgr, "a", seq, 200)  # 51 blocks' worth through a 5-block cache
    assert len(mgr.block_table("a")) == 51


def test_forks_share_and_free_only_what_is_held():
    mgr = KVCacheManager(16, BS, sliding_window=WINDOW)
    seq = tokens(8)
    assert mgr.allocate_slots("a", seq, 0, 8)
    decode(mgr, "a", seq, 24)
    held = list(mgr._requests["a"].held)
    mgr.fork("a", "b")
    assert mgr._requests["b"].num_dropped == mgr._requests["a"].num_dropped
    assert all(mgr._blocks[i].ref_count == 2 for i in held)
    decode(mgr, "b", list(seq), 12)  # the child writes its own blocks, drops its own
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free_blocks == 16
    assert all(block.ref_count == 0 for block in mgr._blocks)


def test_dropped_blocks_stay_cached_for_a_later_prefix_hit():
    mgr = KVCacheManager(32, BS, sliding_window=WINDOW)
    prompt = tokens(40)
    assert mgr.allocate_slots("a", prompt, 0, 20)
    assert mgr.allocate_slots("a", prompt, 20, 20)  # the first chunk's blocks dropped
    assert mgr.stats.window_dropped > 0
    hit = mgr.lookup_prefix("b", prompt)
    assert hit == 36  # every full block but the last token's, dropped ones included
    assert mgr.allocate_slots("b", prompt, hit, 4)
    assert mgr._requests["b"].num_dropped > 0  # and let go of again at once


def test_the_block_map_shows_only_held_blocks():
    mgr = KVCacheManager(16, BS, sliding_window=WINDOW)
    seq = tokens(8)
    assert mgr.allocate_slots("a", seq, 0, 8)
    decode(mgr, "a", seq, 40)
    states = block_states(mgr._blocks, mgr._pool.cached.values(), mgr._requests.values(), BS)
    assert states.count(USED) == len(mgr._requests["a"].held)

"""A hybrid model's KV cache (kvcache/hybrid.py): the full-attention group keeps the
whole context, each sliding-window group only what its window reaches, all from one
pool; allocation is all or nothing across the groups; a prefix hit needs the full
group's blocks from the start and each sliding group's window before the first new
token; only the full group's blocks are announced as events."""

import pytest

from kvserve.kvcache import HybridKVCacheManager
from kvserve.kvcache.block_map import CACHED, USED
from kvserve.kvcache.events import BlockRemoved, BlockStored
from kvserve.kvcache.request_blocks import DROPPED_BLOCK

BS, WINDOW, GROUPS = 4, 6, 2


def tokens(n, start=0):
    return list(range(start, start + n))


def hybrid(num_blocks=64, **kw):
    return HybridKVCacheManager(num_blocks, BS, sliding_window=WINDOW, window_groups=GROUPS,
                                **kw)


def decode(mgr, rid, seq, steps):
    for _ in range(steps):
        seq.append(len(seq) + 1000)
        assert mgr.allocate_slots(rid, seq, len(seq) - 1, 1)


def held(mgr):
    return mgr.num_blocks - mgr.num_free_blocks


def test_the_full_group_keeps_the_context_and_the_windows_only_their_reach():
    mgr = hybrid()
    seq = tokens(8)
    assert mgr.allocate_slots("a", seq, 0, 8)
    assert held(mgr) == 3 * 2  # every group's two blocks
    decode(mgr, "a", seq, 40)  # 48 tokens: 12 blocks' worth
    full = mgr.live_block_table("a")
    assert len(full) == 12 and DROPPED_BLOCK not in full[1:]
    reach = (WINDOW + BS) // BS + 2
    for table in mgr.live_group_tables("a"):
        assert len(table) == 12  # the same logical blocks, the old ones let go of
        kept = [b for b in table if b != DROPPED_BLOCK]
        assert 2 <= len(kept) <= reach
        assert not set(kept) & set(full)  # one pool, each block one group's
    assert held(mgr) <= 12 + GROUPS * reach
    assert mgr.stats.window_dropped >= GROUPS * (12 - reach)
    mgr.free("a")
    assert mgr.num_free_blocks == mgr.num_blocks


def test_allocation_is_all_or_nothing_across_the_groups():
    mgr = hybrid(num_blocks=8)
    assert mgr.allocate_slots("a", tokens(8), 0, 8)  # 2 blocks in each of 3 groups
    before = (mgr.num_free_blocks, mgr.block_table("a"), mgr.live_group_tables("a"))
    # 4 more tokens: a block in each group (3), 2 free
    assert not mgr.allocate_slots("a", tokens(12), 8, 4)
    assert (mgr.num_free_blocks, mgr.block_table("a"),
            tuple(map(list, mgr.live_group_tables("a")))) == \
        (before[0], before[1], tuple(map(list, before[2])))
    mgr.free("a")
    assert mgr.num_free_blocks == 8


def test_a_prefix_hit_takes_each_window_group_only_what_its_window_reaches():
    mgr = hybrid()
    prompt = tokens(40)
    assert mgr.allocate_slots("a", prompt, 0, 40)
    mgr.free("a")  # every group's full blocks stay cached
    hit = mgr.lookup_prefix("b", prompt + [7, 8])
    assert hit == 40  # 10 blocks
    assert len(mgr.live_block_table("b")) == 10
    first = (40 - WINDOW) // BS  # the first block the window reaches from token 40
    for table in mgr.live_group_tables("b"):
        assert table[:first] == [DROPPED_BLOCK] * first
        assert DROPPED_BLOCK not in table[first:]
    assert mgr.allocate_slots("b", prompt + [7, 8], 40, 2)
    assert mgr.stats.prefix_hits == 40
    mgr.free("b")
    assert mgr.num_free_blocks == mgr.num_blocks


@pytest.mark.parametrize("lost, hit", [(9, 36), (8, 32), (0, 40)])
def test_a_hit_is_cut_back_where_a_window_group_lost_a_block_its_window_reads(lost, hit):
    """Block `lost` of the first window group leaves the cache: a hit past it would
    need it inside the window (block 9 or 8 from token 40: the hit ends before it
    and the window from there is whole), and block 0 is outside every window."""
    mgr = hybrid()
    prompt = tokens(40)
    assert mgr.allocate_slots("a", prompt, 0, 40)
    block = mgr._pool.blocks[mgr.live_group_tables("a")[0][lost]]
    mgr.free("a")
    mgr._pool.unregister(block)  # as an eviction would
    assert mgr.lookup_prefix("b", prompt + [1]) == hit
    assert mgr.stats.prefix_hits == hit
    assert len(mgr.live_block_table("b")) == hit // BS
    assert all(len(t) == hit // BS for t in mgr.live_group_tables("b"))
    assert mgr.allocate_slots("b", prompt + [1], hit, 41 - hit)
    mgr.free("b")
    assert mgr.num_free_blocks == mgr.num_blocks


def test_fork_and_free_give_every_group_its_blocks_back():
    mgr = hybrid()
    seq = tokens(30)
    assert mgr.allocate_slots("p", seq, 0, 30)
    mgr.fork("p", "c")
    assert mgr.live_group_tables("c") == mgr.live_group_tables("p")
    assert mgr.allocate_slots("c", seq + [1], 30, 1)  # the shared partial block copied
    copies = mgr.take_copies()
    assert len(copies) == 1 + GROUPS
    mgr.free("p")
    mgr.free("c")
    assert mgr.num_free_blocks == mgr.num_blocks


def test_only_the_full_group_announces_its_blocks():
    mgr = hybrid(num_blocks=12, kv_events=True)
    assert mgr.allocate_slots("a", tokens(16), 0, 16)  # 4 blocks a group: 12 in all
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 4
    announced = {h for e in stored for h in e.block_hashes}
    mgr.free("a")
    assert mgr.allocate_slots("b", tokens(48, start=100), 0, 12)  # evicts every group's
    removed = {h for e in mgr.take_events() if isinstance(e, BlockRemoved)
               for h in e.block_hashes}
    assert removed and removed <= announced


def test_the_block_map_shows_every_groups_blocks():
    mgr = hybrid(num_blocks=16)
    assert mgr.allocate_slots("a", tokens(9), 0, 9)  # 3 blocks a group
    states = mgr.block_states()
    assert states.count(USED) == 9
    mgr.free("a")
    assert mgr.block_states().count(CACHED) == 6  # the full blocks of every group


def test_a_hybrid_cache_needs_a_window():
    with pytest.raises(ValueError):
        HybridKVCacheManager(8, BS, sliding_window=0, window_groups=1)

"""allocate_slots growth, all-or-nothing, accounting and read-outs."""

import pytest

from kvserve.kvcache import KVCacheManager

BS = 4


def tokens(n, start=0):
    return list(range(start, start + n))


def test_tables_grow_one_block_at_a_time():
    mgr = KVCacheManager(8, BS)
    seq = tokens(1)
    assert mgr.allocate_slots("a", seq, 0, 1)
    assert len(mgr.block_table("a")) == 1
    for tok in range(1, 5):
        seq.append(tok)
        assert mgr.allocate_slots("a", seq, tok, 1)
    assert len(mgr.block_table("a")) == 2  # the 5th token opened block 2
    assert mgr.usage == pytest.approx(2 / 8)
    assert mgr.num_free_blocks == 6


def test_nothing_is_reserved_ahead():
    mgr = KVCacheManager(8, BS)
    prompt = tokens(40)  # known tokens beyond the step are not covered
    assert mgr.allocate_slots("a", prompt, 0, 3)
    assert len(mgr.block_table("a")) == 1


def test_allocation_is_all_or_nothing():
    mgr = KVCacheManager(3, BS)
    assert not mgr.allocate_slots("a", tokens(13), 0, 13)
    assert mgr.block_table("a") == [] and mgr.num_free_blocks == 3
    assert mgr.allocate_slots("a", tokens(13), 0, 8)
    table = mgr.block_table("a")
    assert not mgr.allocate_slots("a", tokens(13), 8, 5)
    assert mgr.block_table("a") == table and mgr.num_free_blocks == 1
    assert mgr.stats.evictions == 0


def test_num_new_blocks_needed():
    mgr = KVCacheManager(8, BS)
    assert mgr.num_new_blocks_needed("new", 0) == 0
    assert mgr.num_new_blocks_needed("new", 9) == 3
    assert mgr.allocate_slots("a", tokens(6), 0, 6)
    assert mgr.num_new_blocks_needed("a", 6) == 0
    assert mgr.num_new_blocks_needed("a", 8) == 0
    assert mgr.num_new_blocks_needed("a", 9) == 1
    mgr.fork("a", "b")
    assert mgr.num_new_blocks_needed("a", 6) == 0  # nothing written
    assert mgr.num_new_blocks_needed("a", 7) == 1  # copy of the shared block
    assert mgr.num_new_blocks_needed("a", 9) == 2


def test_bad_ranges_are_rejected():
    mgr = KVCacheManager(8, BS)
    with pytest.raises(ValueError):
        mgr.allocate_slots("a", tokens(3), 0, 4)
    with pytest.raises(ValueError):
        mgr.allocate_slots("a", tokens(3), -1, 1)
    assert mgr.block_table("a") == []


def test_zero_new_tokens_changes_nothing():
    mgr = KVCacheManager(8, BS)
    assert mgr.allocate_slots("a", tokens(5), 0, 5)
    mgr.fork("a", "b")
    assert mgr.allocate_slots("a", tokens(5), 5, 0)
    assert mgr.block_table("a") == mgr.block_table("b")
    assert mgr.take_copies() == []


def test_free_returns_every_block():
    mgr = KVCacheManager(8, BS)
    assert mgr.allocate_slots("a", tokens(10), 0, 10)
    mgr.free("a")
    assert mgr.num_free_blocks == 8 and mgr.usage == 0.0
    assert mgr.block_table("a") == []
    mgr.free("a")  # unknown ids are a no-op
    mgr.free("never-seen")
    assert mgr.num_free_blocks == 8


def test_block_table_is_a_copy():
    mgr = KVCacheManager(8, BS)
    assert mgr.allocate_slots("a", tokens(5), 0, 5)
    mgr.block_table("a").append(99)
    assert mgr.block_table("a") == [0, 1]


def test_constructor_validates_sizes():
    with pytest.raises(ValueError):
        KVCacheManager(0)
    with pytest.raises(ValueError):
        KVCacheManager(8, block_size=0)
    mgr = KVCacheManager(8)
    assert (mgr.num_blocks, mgr.block_size) == (8, 16)


def test_pending_tokens_get_slots_and_are_hashed_once_known():
    """Async scheduling: the token a running step is still sampling is computed by
    the next step before the host knows it. It gets its slot; the block it fills is
    hashed (offered for sharing) only by a later call that knows every token."""
    mgr = KVCacheManager(8, BS)
    seq = tokens(3)
    assert mgr.allocate_slots("a", seq, 0, 3)  # the prompt; it samples token 3
    assert mgr.allocate_slots("a", seq, 3, 1, num_pending_tokens=1)  # token 3 pending
    assert len(mgr.block_table("a")) == 1 and mgr._requests["a"].hashes == []
    seq.append(3)  # its value reaches the host
    assert mgr.allocate_slots("a", seq, 4, 1, num_pending_tokens=1)  # token 4 pending
    assert len(mgr.block_table("a")) == 2
    assert len(mgr._requests["a"].hashes) == 1  # block 0, full and known, hashed now
    # Another prompt with the same first block hits it.
    assert mgr.lookup_prefix("b", tokens(4) + [9]) == BS


def test_pending_tokens_are_bounded_and_copy_on_write():
    mgr = KVCacheManager(8, BS)
    seq = tokens(2)
    with pytest.raises(ValueError):
        mgr.allocate_slots("a", seq, 0, 3)  # a third token nobody is sampling
    assert mgr.allocate_slots("a", seq, 0, 2)
    mgr.fork("a", "b")  # the partly filled block is shared
    assert mgr.allocate_slots("a", seq, 2, 1, num_pending_tokens=1)
    assert mgr.block_table("a") != mgr.block_table("b")  # written privately
    assert [(c.src, c.num_tokens) for c in mgr.take_copies()] == [
        (mgr.block_table("b")[0], 2)]

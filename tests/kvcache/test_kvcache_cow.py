"""fork() and copy-on-write of shared blocks."""

import pytest

from kvserve.kvcache import BlockCopy, KVCacheManager

BS = 4


def tokens(n, start=0):
    return list(range(start, start + n))


def refs(mgr, rid):
    return [mgr._pool.blocks[b].ref_count for b in mgr.block_table(rid)]


def forked(num_blocks=8, prompt_len=6):
    mgr = KVCacheManager(num_blocks, BS)
    prompt = tokens(prompt_len)
    assert mgr.allocate_slots("p", prompt, 0, prompt_len)
    mgr.fork("p", "c")
    return mgr, prompt


def test_fork_shares_every_block_including_the_partial_one():
    mgr, _ = forked()
    assert mgr.block_table("c") == mgr.block_table("p") == [0, 1]
    assert refs(mgr, "c") == [2, 2]
    assert mgr.num_free_blocks == 6 and mgr.take_copies() == []


def test_writing_a_shared_partial_block_copies_it_first():
    mgr, prompt = forked()
    seq_p = prompt + [60]
    assert mgr.num_new_blocks_needed("p", 7) == 1  # the private copy
    assert mgr.allocate_slots("p", seq_p, 6, 1)
    assert mgr.block_table("p") == [0, 2]
    assert mgr.block_table("c") == [0, 1]
    assert mgr.take_copies() == [BlockCopy(src=1, dst=2, num_tokens=2)]
    assert mgr.take_copies() == []
    assert refs(mgr, "p") == [2, 1] and refs(mgr, "c") == [2, 1]
    # The child is now the block's only holder: it writes in place.
    assert mgr.num_new_blocks_needed("c", 7) == 0
    assert mgr.allocate_slots("c", prompt + [70], 6, 1)
    assert mgr.block_table("c") == [0, 1] and mgr.take_copies() == []


def test_full_shared_blocks_are_never_copied():
    mgr, prompt = forked(prompt_len=8)
    assert mgr.num_new_blocks_needed("p", 9) == 1
    assert mgr.allocate_slots("p", prompt + [60], 8, 1)
    assert mgr.block_table("p") == [0, 1, 2]
    assert mgr.block_table("c") == [0, 1]
    assert mgr.take_copies() == []


def test_each_fork_branch_caches_its_own_continuation():
    mgr, prompt = forked()
    seq_p, seq_c = prompt + [60, 61], prompt + [70, 71]
    assert mgr.allocate_slots("p", seq_p, 6, 2)
    assert mgr.allocate_slots("c", seq_c, 6, 2)
    table_p, table_c = mgr.block_table("p"), mgr.block_table("c")
    mgr.free("p")
    mgr.free("c")
    assert mgr.lookup_prefix("p2", seq_p + [1]) == 8
    assert mgr.block_table("p2") == table_p
    assert mgr.lookup_prefix("c2", seq_c + [1]) == 8
    assert mgr.block_table("c2") == table_c


def test_copy_on_write_is_refused_without_a_free_block():
    mgr, prompt = forked(num_blocks=2)
    assert mgr.num_free_blocks == 0
    assert not mgr.allocate_slots("p", prompt + [60], 6, 1)
    assert mgr.take_copies() == []
    assert mgr.block_table("p") == mgr.block_table("c") == [0, 1]
    assert refs(mgr, "p") == [2, 2]


def test_after_the_other_holder_leaves_no_copy_is_needed():
    mgr, prompt = forked()
    mgr.free("p")
    assert mgr.allocate_slots("c", prompt + [70], 6, 1)
    assert mgr.block_table("c") == [0, 1] and mgr.take_copies() == []


def test_fork_of_a_fork_shares_three_ways():
    mgr, prompt = forked()
    mgr.fork("c", "g")
    assert refs(mgr, "g") == [3, 3]
    for rid, tok in (("p", 60), ("c", 70)):
        assert mgr.allocate_slots(rid, prompt + [tok], 6, 1)
    copies = mgr.take_copies()
    assert [(c.src, c.num_tokens) for c in copies] == [(1, 2), (1, 2)]
    assert refs(mgr, "g") == [3, 1]


def test_copies_accumulate_until_taken():
    mgr = KVCacheManager(16, BS)
    for rid in ("a", "b"):
        assert mgr.allocate_slots(rid, tokens(5), 0, 5)
        mgr.fork(rid, rid + "-child")
    for rid in ("a", "b"):
        assert mgr.allocate_slots(rid, tokens(6), 5, 1)
    assert len(mgr.take_copies()) == 2


def test_fork_errors():
    mgr, _ = forked()
    with pytest.raises(KeyError):
        mgr.fork("missing", "x")
    with pytest.raises(ValueError):
        mgr.fork("p", "c")  # c already holds blocks
    with pytest.raises(ValueError):
        mgr.fork("p", "p")

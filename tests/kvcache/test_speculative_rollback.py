"""Speculative drafts in the KV cache: lookahead slots get private blocks but never
hashes, and `settle_verified` after verification leaves a request exactly as if it had never
seen the rejected drafts (block count, hash chain, slot contents)."""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from kvserve.kvcache import KVCacheManager
from tests.kvcache.kvcache_sim import FakeDevice

BS = 4


def test_lookahead_gets_blocks_but_no_hashes():
    kv = KVCacheManager(16, BS)
    tokens = list(range(7))
    assert kv.allocate_slots("a", tokens, 0, 7)
    assert kv.allocate_slots("a", tokens, 6, 1, num_lookahead_tokens=5)  # up to 12
    assert len(kv.block_table("a")) == 3
    assert len(kv._requests["a"].hashes) == 1  # tokens 0..3 only: 4..11 hold drafts
    tokens += [7, 8, 99]  # 2 drafts accepted, then the model's own token
    kv.settle_verified("a", tokens, 9)
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 13
    assert len(kv._requests["a"].hashes) == 2  # the block the drafts filled


def test_lookahead_into_a_shared_last_block_copies_it_first():
    kv = KVCacheManager(16, BS)
    tokens = list(range(6))
    assert kv.allocate_slots("p", tokens, 0, 6)
    kv.fork("p", "c")
    shared = kv.block_table("p")[1]
    # p's next decode writes slot 6 plus two drafts, into the shared block 1
    assert kv.allocate_slots("p", tokens + [9], 6, 1, num_lookahead_tokens=2)
    assert kv.block_table("p")[1] != shared and kv.block_table("c")[1] == shared
    copies = kv.take_copies()
    assert [(c.src, c.num_tokens) for c in copies] == [(shared, 2)]


@settings(max_examples=200, deadline=None)
@given(prompt_len=st.integers(1, 20), steps=st.lists(
    st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=30),
    caching=st.booleans())
def test_rollback_equals_a_request_that_never_saw_rejected_drafts(prompt_len, steps, caching):
    """Each step proposes k drafts and accepts a <= k of them, then appends one
    sampled token; a twin request fed only the verified tokens one decode at a
    time ends with the same table length, hash chain and slot contents."""
    kv, twin = KVCacheManager(64, BS, caching), KVCacheManager(64, BS, caching)
    dev = FakeDevice(64, BS)
    tokens = list(range(1000, 1000 + prompt_len))
    assert kv.allocate_slots("r", tokens, 0, prompt_len - 1)
    dev.write(kv.block_table("r"), tokens, 0, prompt_len - 1)
    assert twin.allocate_slots("r", tokens, 0, prompt_len - 1)
    computed = prompt_len - 1
    for k, accepted in steps:
        a = min(k, accepted)
        drafts = [5000 + len(tokens) + j for j in range(k)]
        if len(tokens) + k > 60:
            break
        assert kv.allocate_slots("r", tokens, computed, 1, num_lookahead_tokens=k)
        table = kv.block_table("r")
        # the device writes the last known token and every draft (rejected ones too)
        dev.write(table, tokens + drafts, computed, computed + 1 + k)
        wrong = [-d for d in drafts[a:]]  # what the model says instead of the rejected
        tokens += drafts[:a] + wrong[:1] + ([] if wrong else [7000 + len(tokens)])
        for pos in range(computed, computed + 1 + a):
            assert twin.allocate_slots("r", tokens, pos, 1)
        computed += 1 + a
        kv.settle_verified("r", tokens, computed)
        mine, theirs = kv._requests["r"], twin._requests["r"]
        assert len(mine.block_ids) == len(theirs.block_ids) == -(-computed // BS)
        assert mine.hashes == theirs.hashes
        assert mine.num_tokens == theirs.num_tokens == computed
        assert dev.read(mine.block_ids, computed) == tokens[:computed]
        assert kv.num_free_blocks == twin.num_free_blocks
    kv.free("r")
    assert kv.num_free_blocks == 64

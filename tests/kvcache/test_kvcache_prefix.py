"""Prefix sharing: hits, the last-token cap, LRU eviction, salts, model keys."""

import pytest

from kvserve.kvcache import KVCacheManager
from kvserve.kvcache.block_hash import BlockHasher, root_hash

BS = 4


def tokens(n, start=0):
    return list(range(start, start + n))


def prefill(mgr, rid, toks, salt=None):
    hit = mgr.lookup_prefix(rid, toks, salt)
    assert mgr.allocate_slots(rid, toks, hit, len(toks) - hit)
    return hit


def free_order(mgr):
    return [b.block_id for b in mgr._pool.free_queue]


def test_prefix_is_hit_after_its_owner_finished():
    mgr = KVCacheManager(16, BS)
    prompt = tokens(10)  # two full blocks and a partial one
    assert prefill(mgr, "a", prompt) == 0
    table_a = mgr.block_table("a")
    mgr.free("a")
    assert mgr.num_free_blocks == 16
    assert mgr.lookup_prefix("b", prompt + [99]) == 8
    assert mgr.block_table("b") == table_a[:2]
    assert mgr.num_free_blocks == 14  # the hit blocks left the free queue


def test_hit_on_blocks_in_use_shares_them():
    mgr = KVCacheManager(16, BS)
    prefill(mgr, "a", tokens(9))
    assert mgr.lookup_prefix("b", tokens(9)) == 8
    shared = mgr.block_table("b")
    assert shared == mgr.block_table("a")[:2]
    assert [mgr._pool.blocks[b].ref_count for b in shared] == [2, 2]
    assert mgr.num_free_blocks == 13


def test_hit_is_capped_so_the_last_token_is_recomputed():
    mgr = KVCacheManager(16, BS)
    prefill(mgr, "a", tokens(8))  # both blocks full and cached
    assert mgr.lookup_prefix("b", tokens(8)) == 4
    assert mgr.lookup_prefix("c", tokens(9)) == 8
    assert mgr.lookup_prefix("d", tokens(5)) == 4
    assert mgr.lookup_prefix("e", tokens(4)) == 0
    assert mgr.lookup_prefix("f", []) == 0


def test_lookup_stops_at_the_first_missing_block():
    mgr = KVCacheManager(16, BS)
    prefill(mgr, "a", tokens(13))
    diverged = tokens(4) + [77] + tokens(8, start=5)
    assert mgr.lookup_prefix("b", diverged) == 4


def test_eviction_is_lru_and_chain_tails_go_first():
    mgr = KVCacheManager(6, BS)
    prefill(mgr, "a", tokens(13))  # blocks 0,1,2 full (cached), 3 partial
    assert mgr.block_table("a") == [0, 1, 2, 3]
    mgr.free("a")
    # The partial block is worthless: front. The chain enters tail-first.
    assert free_order(mgr) == [3, 4, 5, 2, 1, 0]
    prefill(mgr, "b", tokens(16, start=100))
    assert mgr.block_table("b") == [3, 4, 5, 2]
    assert mgr.stats.evictions == 1
    mgr.free("b")
    assert mgr.lookup_prefix("c", tokens(13)) == 8
    assert mgr.block_table("c") == [0, 1]


def test_least_recently_freed_prefix_is_evicted_first():
    mgr = KVCacheManager(3, BS)
    x, y = tokens(4, start=10), tokens(4, start=20)
    prefill(mgr, "x", x)
    prefill(mgr, "y", y)
    mgr.free("x")
    mgr.free("y")
    # A hit on x and a later free make x the most recently used.
    assert mgr.lookup_prefix("x2", x + [1]) == 4
    mgr.free("x2")
    prefill(mgr, "z", tokens(8, start=50))  # needs 2: plain block 2, then y
    assert mgr.stats.evictions == 1
    mgr.free("z")
    assert mgr.lookup_prefix("hit-x", x + [1]) == 4
    assert mgr.lookup_prefix("miss-y", y + [1]) == 0


def test_cache_salt_separates_tenants():
    mgr = KVCacheManager(32, BS)
    prompt = tokens(9)
    prefill(mgr, "a", prompt, salt="tenant-1")
    assert mgr.lookup_prefix("b", prompt, "tenant-2") == 0
    assert mgr.lookup_prefix("c", prompt, None) == 0
    assert mgr.lookup_prefix("d", prompt, "") == 0
    assert mgr.lookup_prefix("e", prompt, "tenant-1") == 8


def test_salt_recorded_by_lookup_is_used_when_hashing_later():
    mgr = KVCacheManager(32, BS)
    prefill(mgr, "a", tokens(9), salt="t")
    mgr.free("a")
    assert mgr.lookup_prefix("b", tokens(9)) == 0
    assert mgr.lookup_prefix("c", tokens(9), "t") == 8


def test_implicitly_created_requests_hash_without_salt():
    mgr = KVCacheManager(32, BS)
    assert mgr.allocate_slots("a", tokens(9), 0, 9)
    assert mgr.lookup_prefix("b", tokens(9)) == 8
    assert mgr.lookup_prefix("c", tokens(9), "t") == 0


def test_model_key_separates_models():
    assert root_hash("llama", None) != root_hash("llama+lora", None)
    managers = [KVCacheManager(8, BS, model_key=k) for k in ("llama", "llama+lora")]
    for mgr in managers:
        prefill(mgr, "a", tokens(9))
    first, second = (set(m._pool.cached) for m in managers)
    assert len(first) == len(second) == 2 and not first & second


def test_block_hash_chains_on_the_parent():
    hasher = BlockHasher(BS)
    root = root_hash("", None)
    h1 = hasher.hash_block(root, tokens(4))
    assert len(h1) == 32  # sha256: collisions are not a practical concern
    assert hasher.hash_block(h1, tokens(4)) != h1
    assert hasher.hash_block(root, tokens(4)) == h1
    assert root_hash("ab", "c") != root_hash("a", "bc")


def test_bulk_hashing_matches_block_by_block():
    hasher = BlockHasher(BS)
    root = root_hash("m", "salt")
    seq = tokens(14, start=2**40)
    chain, parent = [], root
    for start in range(0, 12, BS):
        parent = hasher.hash_block(parent, seq[start : start + BS])
        chain.append(parent)
    assert hasher.hash_blocks(root, seq, 0, 3) == chain
    assert hasher.hash_blocks(chain[0], seq, 1, 3) == chain[1:]
    assert hasher.hash_blocks(root, seq, 2, 2) == []


def test_chunked_prefill_hashes_like_one_shot():
    chunked, whole = KVCacheManager(8, BS), KVCacheManager(8, BS)
    prompt = tokens(14)
    done = 0
    for chunk in (5, 3, 6):
        assert chunked.allocate_slots("a", prompt, done, chunk)
        done += chunk
    assert whole.allocate_slots("a", prompt, 0, 14)
    assert set(chunked._pool.cached) == set(whole._pool.cached)
    assert len(chunked._pool.cached) == 3
    assert chunked.lookup_prefix("b", prompt) == 12


def test_only_written_tokens_are_hashed():
    mgr = KVCacheManager(8, BS)
    prompt = tokens(12)
    assert mgr.allocate_slots("a", prompt, 0, 7)  # block 1 not yet full
    assert len(mgr._pool.cached) == 1
    assert mgr.lookup_prefix("b", prompt) == 4


def test_preempted_request_hits_its_own_freed_blocks():
    mgr = KVCacheManager(8, BS)
    seq = tokens(6)
    prefill(mgr, "a", seq)
    for tok in range(100, 106):  # decode one token per step
        seq.append(tok)
        assert mgr.allocate_slots("a", seq, len(seq) - 1, 1)
    table = mgr.block_table("a")
    mgr.free("a")  # preempted
    assert mgr.lookup_prefix("a", seq) == 8  # 12 tokens: last one recomputed
    assert mgr.block_table("a") == table[:2]
    assert mgr.allocate_slots("a", seq, 8, 4)
    mgr.free("a")
    assert mgr.lookup_prefix("a", seq + [200]) == 12


def test_identical_prompts_computed_together_share_afterwards():
    mgr = KVCacheManager(8, BS)
    prompt = tokens(9)
    assert mgr.lookup_prefix("a", prompt) == 0
    assert mgr.lookup_prefix("b", prompt) == 0
    assert mgr.allocate_slots("a", prompt, 0, 9)
    assert mgr.allocate_slots("b", prompt, 0, 9)
    table_a, table_b = mgr.block_table("a"), mgr.block_table("b")
    assert len(mgr._pool.cached) == 2  # b's duplicates stay unregistered
    mgr.free("b")
    mgr.free("a")
    # Plain blocks (b's duplicates, a's partial one) are reused first.
    assert set(free_order(mgr)[:4]) == set(table_b) | {table_a[2]}
    assert mgr.lookup_prefix("c", prompt) == 8
    assert mgr.block_table("c") == table_a[:2]


def test_prefix_caching_disabled():
    mgr = KVCacheManager(8, BS, enable_prefix_caching=False)
    prefill(mgr, "a", tokens(9))
    mgr.free("a")
    assert mgr.lookup_prefix("b", tokens(9)) == 0
    assert not mgr._pool.cached
    assert mgr.stats.prefix_queries == mgr.stats.prefix_hits == 0


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    mgr = KVCacheManager(8, BS)
    prefill(mgr, "a", tokens(9))
    assert not mgr.reset_prefix_cache()
    assert mgr.lookup_prefix("b", tokens(9)) == 8
    mgr.free("a")
    mgr.free("b")
    assert mgr.reset_prefix_cache()
    assert mgr.lookup_prefix("c", tokens(9)) == 0
    assert mgr.num_free_blocks == 8


def test_stats_count_tokens_and_evictions():
    mgr = KVCacheManager(3, BS)
    prefill(mgr, "a", tokens(9))  # 9 queried, 0 hit
    mgr.free("a")
    prefill(mgr, "b", tokens(10))  # 10 queried, 8 hit
    assert (mgr.stats.prefix_queries, mgr.stats.prefix_hits) == (19, 8)
    assert mgr.stats.hit_rate == pytest.approx(8 / 19)
    mgr.free("b")
    assert mgr.stats.evictions == 0
    prefill(mgr, "c", tokens(12, start=50))  # all 3 blocks, 2 of them cached
    assert mgr.stats.evictions == 2


def test_lookup_for_a_request_holding_blocks_is_an_error():
    mgr = KVCacheManager(8, BS)
    prefill(mgr, "a", tokens(5))
    with pytest.raises(ValueError):
        mgr.lookup_prefix("a", tokens(5))


def test_lookup_without_matching_hits_nothing_but_keeps_the_salt():
    mgr = KVCacheManager(32, BS)
    prefill(mgr, "a", tokens(9), salt="t")
    queries = mgr.stats.prefix_queries
    assert mgr.lookup_prefix("b", tokens(9), "t", match=False) == 0
    assert mgr.stats.prefix_queries == queries
    assert mgr.allocate_slots("b", tokens(9, start=100), 0, 9)  # registered under "t"
    mgr.free("b")
    assert mgr.lookup_prefix("c", tokens(9, start=100)) == 0
    assert mgr.lookup_prefix("d", tokens(9, start=100), "t") == 8

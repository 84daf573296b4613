"""Pins on a finished prompt's cached blocks (a prefill instance holding them for
a decode instance): kept from eviction while pinned, back in the cache after."""

from kvserve.kvcache import KVCacheManager

BS = 4


def prefill_and_free(mgr, rid, toks, salt=None):
    hit = mgr.lookup_prefix(rid, toks, salt)
    assert mgr.allocate_slots(rid, toks, hit, len(toks) - hit)
    table = mgr.block_table(rid)
    mgr.free(rid)
    return table


def test_pins_hold_the_prompts_usable_blocks_and_give_them_back():
    mgr = KVCacheManager(8, BS, model_key="m")
    prompt = list(range(13))  # three full blocks; the third holds the last token's
    table = prefill_and_free(mgr, "a", prompt)  # neighbour, so a lookup hits all three
    pinned = mgr.pin_prefix(prompt)
    assert [b for b, _ in pinned] == table[:3]
    assert [h for _, h in pinned] == mgr.prompt_hashes(prompt)
    assert mgr.num_free_blocks == 8 - 3
    # Pinned blocks survive a flood that takes every other block.
    assert mgr.lookup_prefix("flood", list(range(100, 120))) == 0
    assert mgr.allocate_slots("flood", list(range(100, 120)), 0, 20)
    mgr.free("flood")
    assert mgr.lookup_prefix("b", prompt) == 12
    mgr.free("b")
    mgr.unpin([b for b, _ in pinned])
    assert mgr.num_free_blocks == 8
    assert mgr.lookup_prefix("c", prompt) == 12  # unpinned blocks stay cached


def test_pins_stop_at_the_first_block_not_cached_and_keep_salts_apart():
    mgr = KVCacheManager(8, BS, model_key="m")
    prompt = list(range(13))
    prefill_and_free(mgr, "a", prompt[:9] + [77] * 4, salt="tenant-a")
    assert mgr.pin_prefix(prompt, "tenant-b") == []  # another tenant's KV: no pins
    pinned = mgr.pin_prefix(prompt, "tenant-a")
    assert len(pinned) == 2  # the third block differs
    mgr.unpin([b for b, _ in pinned])
    assert mgr.num_free_blocks == 8


def test_nothing_is_pinned_with_prefix_caching_off():
    mgr = KVCacheManager(8, BS, enable_prefix_caching=False)
    prefill_and_free(mgr, "a", list(range(13)))
    assert mgr.pin_prefix(list(range(13))) == []

"""The block pool's side of the second KV tier (kvcache/second_tier.py): what it
evicts is handed on, a lookup walks on into the tier after the cache's last hit,
and only blocks whose KV was written are ever handed on."""
from __future__ import annotations

from kvserve.kvcache import KVCacheManager


class RecordingTier:
    """A tier that holds whatever it is given, and says what it was asked."""

    def __init__(self, refuse: frozenset = frozenset()):
        self.held: set[bytes] = set()
        self.saves: list[tuple[int, bytes]] = []
        self.loads: list[tuple[bytes, int]] = []
        self.refuse = refuse  # hashes find() turns down (a corrupt copy)

    def save(self, block_id, block_hash):
        self.saves.append((block_id, block_hash))
        self.held.add(block_hash)

    def find(self, block_hash):
        return block_hash in self.held and block_hash not in self.refuse

    def load(self, block_hash, block_id):
        self.loads.append((block_hash, block_id))

    def clear(self):
        self.held.clear()


def fill(kv, rid, tokens):
    assert kv.lookup_prefix(rid, tokens) == 0
    assert kv.allocate_slots(rid, tokens, 0, len(tokens))
    kv.free(rid)


def evicted_history():
    """(tier, manager, history): the history's 5 full blocks (and one token) filled,
    then evicted to the tier by 8 blocks of another prompt."""
    tier = RecordingTier()
    kv = KVCacheManager(num_blocks=8, block_size=4, tier=tier)
    history = list(range(100, 121))
    fill(kv, "a", history)
    fill(kv, "b", list(range(200, 232)))
    return tier, kv, history


def test_evicted_blocks_go_to_the_tier_and_come_back_as_hits():
    tier, kv, history = evicted_history()
    saved = {h for _, h in tier.saves}
    assert len(saved) == 5 and not tier.loads

    hit = kv.lookup_prefix("c", history)
    assert hit == 20  # all 5 full blocks (the last token is computed)
    assert [h for h, _ in tier.loads] == [h for h in kv._requests["c"].hashes]
    assert [b for _, b in tier.loads] == kv.block_table("c")
    assert kv.stats.tier_hits == 20 and kv.stats.prefix_hits == 20
    assert kv.allocate_slots("c", history, hit, 1)
    kv.free("c")
    # Loaded blocks are cached again: the next lookup hits them in the cache itself.
    loads = len(tier.loads)
    assert kv.lookup_prefix("d", history) == 20 and len(tier.loads) == loads
    kv.free("d")
    assert kv.num_free_blocks == 8


def test_the_chain_stops_at_the_first_block_the_tier_turns_down():
    tier, kv, history = evicted_history()
    third = kv._hasher.hash_block(kv._hasher.hash_block(kv._hasher.hash_block(
        kv._unsalted_root, history[0:4]), history[4:8]), history[8:12])
    tier.refuse = frozenset({third})
    assert kv.lookup_prefix("c", history) == 8
    kv.free("c")


def test_no_more_blocks_load_than_are_free():
    tier, kv, history = evicted_history()
    other = list(range(300, 317))
    assert kv.lookup_prefix("hold", other) == 0 and kv.allocate_slots("hold", other, 0, 17)
    assert kv.num_free_blocks == 3
    assert kv.lookup_prefix("c", history) == 12
    assert len(kv._requests["c"].hashes) == 3 == len(kv.block_table("c"))
    kv.free("c")
    kv.free("hold")
    assert kv.num_free_blocks == 8


def test_blocks_never_written_are_not_handed_on():
    tier = RecordingTier()
    kv = KVCacheManager(num_blocks=8, block_size=4, tier=tier)
    tokens = list(range(100, 116))
    assert kv.lookup_prefix("a", tokens) == 0
    assert kv.allocate_slots("a", tokens, 0, 16)  # registered before the step runs
    kv.free("a", num_computed_tokens=0)  # preempted: its step was taken back
    fill(kv, "b", list(range(200, 232)))
    assert tier.saves == []


def test_a_reset_prefix_cache_clears_the_tier():
    tier, kv, _ = evicted_history()
    assert tier.held and kv.reset_prefix_cache() and not tier.held

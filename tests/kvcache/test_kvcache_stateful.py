"""Property-based test: random engine-like traffic against a reference model.

The reference model is each live request's token list and how many of its
tokens have KV written; the fake device holds what was actually written into
each physical block. After every step the pool's bookkeeping must match the
tables, and every request must read back exactly its own tokens.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvserve.kvcache import KVCacheManager
from kvserve.kvcache.block_hash import BlockHasher
from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.kvcache.kvcache_sim import FakeDevice, check_pool_invariants

# A tiny vocabulary makes shared prefixes (and so prefix hits) common.
TOKENS = st.integers(min_value=0, max_value=2)
# Prompts often start with a shared "system prompt" so prefix hits are frequent.
SYSTEM_PROMPTS = st.sampled_from([[], [0, 1, 2, 0, 1, 2, 0, 1, 2], [2] * 12])
PROMPTS = st.builds(
    lambda head, tail: head + tail, SYSTEM_PROMPTS, st.lists(TOKENS, min_size=1, max_size=16)
)
MAX_LEN = 48
MAX_LIVE = 6  # more would mostly produce refused allocations


class Req:
    def __init__(self, tokens: list[int], computed: int, salt: str | None) -> None:
        self.tokens = tokens
        self.computed = computed  # tokens whose KV is on the device
        self.salt = salt


def sample_decodes(live: dict, data) -> None:
    """Every fully computed request gets a freshly sampled token to decode."""
    for rid in sorted(live):
        req = live[rid]
        if req.computed == len(req.tokens) and len(req.tokens) < MAX_LEN:
            req.tokens.append(data.draw(TOKENS, label=rid))


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_blocks=st.one_of(st.integers(1, 6), st.integers(7, 40)),
        caching=st.booleans(),
    )
    def setup(self, block_size: int, num_blocks: int, caching: bool) -> None:
        self.mgr = KVCacheManager(num_blocks, block_size, caching, model_key="m",
                                  kv_events=True)
        self.from_events: set[bytes] = set()  # the cached hashes, as events tell them
        self.dev = FakeDevice(num_blocks, block_size)
        self.bs = block_size
        self.live: dict[str, Req] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _admit(self, rid: str, tokens: list[int], salt: str | None) -> None:
        """lookup_prefix and check the hit against the spec and the device."""
        queries, hits = self.mgr.stats.prefix_queries, self.mgr.stats.prefix_hits
        hit = self.mgr.lookup_prefix(rid, tokens, salt)
        assert hit % self.bs == 0 and 0 <= hit <= max(0, len(tokens) - 1)
        if not self.mgr.enable_prefix_caching:
            assert hit == 0 and self.mgr.stats.prefix_queries == queries
        else:
            assert self.mgr.stats.prefix_queries == queries + len(tokens)
            assert self.mgr.stats.prefix_hits == hits + hit
        table = self.mgr.block_table(rid)
        assert len(table) == hit // self.bs
        assert self.dev.read(table, hit) == tokens[:hit]
        event("prefix hit" if hit else "prefix miss")
        self.live[rid] = Req(tokens, hit, salt)

    def _pick(self, data, where=lambda r: True) -> str:
        return data.draw(st.sampled_from(sorted(r for r, q in self.live.items() if where(q))))

    # ------------------------------------------------------------ rules

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(
        prompt=PROMPTS,
        salt=st.sampled_from([None, None, "tenant"]),
    )
    def add_request(self, prompt: list[int], salt: str | None) -> None:
        self._admit(self._new_id(), prompt, salt)

    @precondition(lambda self: any(r.computed < len(r.tokens) for r in self.live.values()))
    @rule(data=st.data())
    def schedule_step(self, data) -> None:
        """One engine step: allocate for every pending request (chunk sizes
        drawn, 0 = not scheduled), then apply the copies, then write the KV."""
        writes = []
        for rid in sorted(self.live):
            req = self.live[rid]
            n = data.draw(st.integers(0, len(req.tokens) - req.computed), label=rid)
            if n and self._allocate(rid, req, n):
                writes.append((rid, req, n))
        copies = self.mgr.take_copies()
        if copies:
            event("copy-on-write copy")
        self.dev.apply_copies(copies)
        for rid, req, n in writes:
            table = self.mgr.block_table(rid)
            end = req.computed + n
            for pos in range(req.computed, end):
                # After copy-on-write, nobody else may hold a block we write.
                assert self.mgr._pool.blocks[table[pos // self.bs]].ref_count == 1
            self.dev.write(table, req.tokens, req.computed, end)
            req.computed = end

    def _allocate(self, rid: str, req: Req, n: int) -> bool:
        before_table = self.mgr.block_table(rid)
        before_refs = [b.ref_count for b in self.mgr._pool.blocks]
        free = self.mgr.num_free_blocks
        need = self.mgr.num_new_blocks_needed(rid, req.computed + n)
        ok = self.mgr.allocate_slots(rid, req.tokens, req.computed, n)
        assert ok == (need <= free)
        table = self.mgr.block_table(rid)
        if not ok:  # all or nothing
            event("allocation refused")
            assert table == before_table and self.mgr.num_free_blocks == free
            assert [b.ref_count for b in self.mgr._pool.blocks] == before_refs
            return False
        assert self.mgr.num_free_blocks == free - need
        assert len(table) == -(-(req.computed + n) // self.bs)
        self.dev.scramble(set(table) - set(before_table))
        return True

    @precondition(lambda self: any(r.computed == len(r.tokens) for r in self.live.values()))
    @rule(data=st.data())
    def sample_tokens(self, data) -> None:
        sample_decodes(self.live, data)

    @precondition(lambda self: 0 < len(self.live) < MAX_LIVE)
    @rule(data=st.data(), sampled=TOKENS)
    def fork(self, data, sampled: int) -> None:
        """Parallel sampling: the child continues with its own sampled token."""
        parent_id = self._pick(data)
        parent = self.live[parent_id]
        child_id = self._new_id()
        self.mgr.fork(parent_id, child_id)
        assert self.mgr.block_table(child_id) == self.mgr.block_table(parent_id)
        tokens = parent.tokens[: parent.computed] + [sampled]
        self.live[child_id] = Req(tokens, parent.computed, parent.salt)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_or_abort(self, data) -> None:
        rid = self._pick(data)
        self._free_and_check(rid)
        del self.live[rid]
        free = self.mgr.num_free_blocks
        self.mgr.free(rid)  # a second free (and any unknown id) is a no-op
        assert self.mgr.num_free_blocks == free

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt_and_readmit(self, data) -> None:
        """Free (recompute-style preemption), then admit again by prefix lookup."""
        rid = self._pick(data)
        req = self.live.pop(rid)
        self._free_and_check(rid)
        self._admit(rid, req.tokens, req.salt)

    def _free_and_check(self, rid: str) -> None:
        blocks = self.mgr._pool.blocks
        table = self.mgr.block_table(rid)
        refs = [blocks[b].ref_count for b in table]
        free = self.mgr.num_free_blocks
        self.mgr.free(rid)
        assert self.mgr.block_table(rid) == []
        assert [blocks[b].ref_count for b in table] == [r - 1 for r in refs]
        assert self.mgr.num_free_blocks == free + refs.count(1)

    @rule()
    def reset_prefix_cache(self) -> None:
        all_free = self.mgr.num_free_blocks == self.mgr.num_blocks
        assert self.mgr.reset_prefix_cache() == all_free
        if all_free:
            event("prefix cache reset")
            assert not self.mgr._pool.cached

    # -------------------------------------------------------- invariants

    @invariant()
    def pool_is_consistent(self) -> None:
        check_pool_invariants(self.mgr, self.live)
        if not self.live:
            assert self.mgr.num_free_blocks == self.mgr.num_blocks

    @invariant()
    def events_tell_the_cached_hashes(self) -> None:
        """Replaying the events alone gives the pool's hash set; a stored run's
        hashes are its tokens chained from its parent."""
        for e in self.mgr.take_events():
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * self.bs
                if e.parent_block_hash is not None:
                    assert BlockHasher(self.bs).hash_blocks(
                        e.parent_block_hash, e.token_ids, 0,
                        len(e.block_hashes)) == e.block_hashes
                self.from_events.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.from_events
                self.from_events.difference_update(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.from_events.clear()
        assert self.from_events == set(self.mgr._pool.cached)

    @invariant()
    def tables_read_back_their_tokens(self) -> None:
        for rid, req in self.live.items():
            table = self.mgr.block_table(rid)
            assert len(table) == -(-req.computed // self.bs)
            assert self.dev.read(table, req.computed) == req.tokens[: req.computed]

    def teardown(self) -> None:
        if not hasattr(self, "mgr"):
            return
        for rid in list(self.live):
            self.mgr.free(rid)
        assert self.mgr.num_free_blocks == self.mgr.num_blocks
        assert self.mgr.usage == 0.0


KVCacheMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheStateMachine = KVCacheMachine.TestCase

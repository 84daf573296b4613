"""Property-based test of a hybrid model's cache (kvcache/hybrid.py): random
engine-like traffic (prompts with shared heads, chunked steps, decodes, forks,
preemption with prefix hits, frees) against a fake device that every layer group
writes its own blocks of. After every step: each block's references are the tables'
holdings across the groups, the full group's table reads back every computed token,
and each sliding group's reads back at least the window before the next token."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.kvcache import HybridKVCacheManager
from kvserve.kvcache.request_blocks import DROPPED_BLOCK
from tests.kvcache.kvcache_sim import FakeDevice
from tests.kvcache.test_kvcache_stateful import PROMPTS, TOKENS, Req, sample_decodes

MAX_LIVE = 5


class HybridCacheMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), window=st.integers(1, 9),
                groups=st.integers(1, 3), num_blocks=st.integers(3, 60),
                caching=st.booleans())
    def setup(self, block_size, window, groups, num_blocks, caching) -> None:
        self.mgr = HybridKVCacheManager(num_blocks, block_size, caching, "m",
                                        sliding_window=window, window_groups=groups)
        self.dev = FakeDevice(num_blocks, block_size)
        self.bs, self.window = block_size, window
        self.live: dict[str, Req] = {}
        self.next_id = 0

    def _tables(self, rid: str) -> list[list[int]]:
        return [self.mgr.block_table(rid), *map(list, self.mgr.live_group_tables(rid))]

    def _admit(self, rid: str, tokens: list[int]) -> None:
        hit = self.mgr.lookup_prefix(rid, tokens)
        assert hit % self.bs == 0 and 0 <= hit <= max(0, len(tokens) - 1)
        event("prefix hit" if hit else "prefix miss")
        self.live[rid] = Req(tokens, hit, None)

    def _pick(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.live)))

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(prompt=PROMPTS)
    def add_request(self, prompt) -> None:
        self.next_id += 1
        self._admit(f"r{self.next_id}", prompt)

    @precondition(lambda self: any(r.computed < len(r.tokens) for r in self.live.values()))
    @rule(data=st.data())
    def schedule_step(self, data) -> None:
        writes = []
        for rid in sorted(self.live):
            req = self.live[rid]
            n = data.draw(st.integers(0, len(req.tokens) - req.computed), label=rid)
            if not n:
                continue
            before, free = self._tables(rid), self.mgr.num_free_blocks
            if self.mgr.allocate_slots(rid, req.tokens, req.computed, n):
                writes.append((rid, req, n))
            else:  # nothing allocated in any group (blocks the windows have passed
                # may have been let go of on the way: never read again)
                event("allocation refused")
                after = self._tables(rid)
                assert after[0] == before[0] and self.mgr.num_free_blocks >= free
                for old, new in zip(before[1:], after[1:]):
                    assert len(old) == len(new)
                    assert all(n in (o, DROPPED_BLOCK) for o, n in zip(old, new))
        self.dev.apply_copies(self.mgr.take_copies())
        for rid, req, n in writes:
            end = req.computed + n
            for table in self._tables(rid):  # each group's layers write its blocks
                self.dev.write(table, req.tokens, req.computed, end)
            req.computed = end

    @precondition(lambda self: any(r.computed == len(r.tokens) for r in self.live.values()))
    @rule(data=st.data())
    def sample_tokens(self, data) -> None:
        sample_decodes(self.live, data)

    @precondition(lambda self: 0 < len(self.live) < MAX_LIVE)
    @rule(data=st.data(), sampled=TOKENS)
    def fork(self, data, sampled) -> None:
        parent_id = self._pick(data)
        parent = self.live[parent_id]
        self.next_id += 1
        child_id = f"r{self.next_id}"
        self.mgr.fork(parent_id, child_id)
        assert self._tables(child_id) == self._tables(parent_id)
        self.live[child_id] = Req(parent.tokens[:parent.computed] + [sampled],
                                  parent.computed, None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data) -> None:
        rid = self._pick(data)
        del self.live[rid]
        self.mgr.free(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt_and_readmit(self, data) -> None:
        rid = self._pick(data)
        req = self.live.pop(rid)
        self.mgr.free(rid, req.computed)
        self._admit(rid, req.tokens)

    @invariant()
    def references_are_the_groups_holdings(self) -> None:
        holders: Counter = Counter()
        groups = [self.mgr.full, *self.mgr.windows]
        for rid in self.live:
            for group in groups:
                held = group._requests[rid].held
                assert len(set(held)) == len(held)
                holders.update(held)
        for block in self.mgr._pool.blocks:
            assert block.ref_count == holders[block.block_id], block
        assert self.mgr.num_free_blocks == sum(b.ref_count == 0 for b in self.mgr._pool.blocks)

    @invariant()
    def tables_read_back_what_their_layers_read(self) -> None:
        bs = self.bs
        for rid, req in self.live.items():
            full, *windows = self._tables(rid)
            assert self.dev.read(full, req.computed) == req.tokens[:req.computed]
            for group, table in zip(self.mgr.windows, windows):
                dropped = group._requests[rid].num_dropped
                # the keys the next query reads (positions past computed - window)
                assert dropped * bs <= max(0, req.computed - self.window)
                kept = range(dropped * bs, req.computed)
                assert [self.dev.slots[table[p // bs]][p % bs] for p in kept] == \
                    req.tokens[dropped * bs:req.computed]

    def teardown(self) -> None:
        if hasattr(self, "mgr"):
            for rid in list(self.live):
                self.mgr.free(rid)
            assert self.mgr.num_free_blocks == self.mgr.num_blocks


HybridCacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestHybridCache = HybridCacheMachine.TestCase

"""The KV cache of a model whose layers read different spans (Gemma 2/3, gpt-oss:
sliding-window layers between full-attention ones), split into layer groups as
vLLM's hybrid allocator does.

The full-attention layers are one group; the sliding-window layers are cut into
groups of the same size (the last may be smaller). A physical block holds one
group's layers for block_size tokens, and every group draws its blocks from one
shared pool, so the memory a sliding group lets go of as its window moves on serves
any group next. Each group keeps its own block table per request (a KVCacheManager
over the shared pool): the full group's table covers the whole context as always;
a sliding group's holds only the blocks its window still reaches, the rest entered
as let go of. A long request then costs one block per block_size tokens, plus the
windows' few, instead of every group's blocks for the whole context.

Prefix caching runs per group over its own hash chain (the model key tells the
groups apart): a hit needs the full group's blocks from the start and, in each
sliding group, only the blocks the window reaches before the first new token.
Only the full group's blocks are announced as KV events (the prefixes a router can
place requests by)."""

from __future__ import annotations

from collections.abc import Sequence

from .block_map import block_states
from .block_pool import BlockPool
from .events import KVCacheEvent, KVEventLog
from .manager import KVCacheManager
from .records import BlockCopy, CacheStats


class HybridKVCacheManager:
    """Layer groups over one block pool; the scheduler's KVCacheManager interface
    (allocation is all or nothing across the groups), plus live_group_tables."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        model_key: str = "",
        kv_events: bool = False,
        sliding_window: int = 0,
        window_groups: int = 1,
    ) -> None:
        if sliding_window <= 0 or window_groups < 1:
            raise ValueError("a hybrid cache needs a window and at least one window group")
        self._pool = BlockPool(num_blocks, CacheStats(),
                               KVEventLog(block_size) if kv_events else None)
        self.full = KVCacheManager(num_blocks, block_size, enable_prefix_caching, model_key,
                                   pool=self._pool)
        self.windows = [
            KVCacheManager(num_blocks, block_size, enable_prefix_caching,
                           f"{model_key}\x00window group {g}", sliding_window=sliding_window,
                           pool=self._pool, announce=False)
            for g in range(window_groups)]
        self._groups = [self.full, *self.windows]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = sliding_window
        self.stats = self._pool.stats
        # Where every layer has a window (the scheduler asks): not here.
        self.sliding_window = 0

    # ----------------------------------------------------------- accounting

    # The pool's, shared by every group (KVCacheManager's meanings).
    num_free_blocks = property(lambda self: self._pool.num_free)
    usage = property(lambda self: self._pool.usage)

    def num_new_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Every group's (new blocks; what the windows let go of not counted)."""
        return sum(g.num_new_blocks_needed(request_id, num_total_tokens) for g in self._groups)

    # ------------------------------------------------------- prefix lookup

    def lookup_prefix(self, request_id: str, token_ids: Sequence[int],
                      cache_salt: str | None = None, match: bool = True,
                      adapter: str | None = None) -> int:
        """The full group's hit, cut back to where every sliding group also holds
        the blocks its window reaches (KVCacheManager.lookup_prefix's contract)."""
        hit = self.full.lookup_prefix(request_id, token_ids, cache_salt, match, adapter)
        num = hit // self.block_size
        chains = [w.window_chain(token_ids, num, cache_salt, adapter) for w in self.windows]
        num = self._longest_window_hit(num, [cached for _, _, cached in chains])
        for window, (root, hashes, _) in zip(self.windows, chains):
            window.attach_window(request_id, root, hashes[:num])
        self.full.truncate_hit(request_id, num)
        return num * self.block_size

    def _longest_window_hit(self, num: int, cached: list[list[bool]]) -> int:
        """The most blocks k <= num such that every group has blocks
        [window_start(k), k) cached."""
        misses = [0] * (num + 1)  # misses[i]: blocks < i some group lacks
        for i in range(num):
            misses[i + 1] = misses[i] + (not all(c[i] for c in cached))
        start = self.windows[0].window_start
        for k in range(num, 0, -1):
            if misses[k] == misses[start(k)]:
                return k
        return 0

    # ----------------------------------------------------------- allocation

    def allocate_slots(self, request_id: str, token_ids: Sequence[int],
                       num_computed_tokens: int, num_new_tokens: int,
                       num_lookahead_tokens: int = 0, num_pending_tokens: int = 0) -> bool:
        """Every group's blocks for these tokens, or none (blocks the windows have
        passed are let go of first)."""
        if num_new_tokens == 1 and not num_lookahead_tokens and self._append_everywhere(
                request_id, token_ids, num_computed_tokens,
                len(token_ids) + num_pending_tokens):
            return True
        wanted = sum(g.blocks_wanted(request_id, num_computed_tokens, num_new_tokens,
                                     num_lookahead_tokens) for g in self._groups)
        if wanted > self._pool.num_free:
            return False
        for group in self._groups:
            if not group.allocate_slots(request_id, token_ids, num_computed_tokens,
                                        num_new_tokens, num_lookahead_tokens,
                                        num_pending_tokens):
                raise AssertionError("a layer group's blocks did not fit after all")
        return True

    def _append_everywhere(self, request_id: str, token_ids: Sequence[int], pos: int,
                           known: int) -> bool:
        """The decode fast path in every group, or in none: the groups' tables have
        the same logical blocks, shared and copied on write together, so where the
        full group's last block takes the token in place every group's does."""
        if not self.full.append_in_place(request_id, token_ids, pos, known):
            return False
        for window in self.windows:
            if not window.append_in_place(request_id, token_ids, pos, known):
                raise AssertionError("a sliding group's last block is not its own")
        return True

    def settle_verified(self, request_id: str, token_ids: Sequence[int],
                        num_tokens: int) -> None:
        for group in self._groups:
            group.settle_verified(request_id, token_ids, num_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        for group in self._groups:
            group.fork(parent_id, child_id)

    def free(self, request_id: str, num_computed_tokens: int | None = None) -> None:
        for group in self._groups:
            group.free(request_id, num_computed_tokens)

    def uncache(self, request_id: str, num_computed_tokens: int) -> None:
        for group in self._groups:
            group.uncache(request_id, num_computed_tokens)

    # ----------------------------------------------------------- read-outs

    def block_table(self, request_id: str) -> list[int]:
        return self.full.block_table(request_id)

    def live_block_table(self, request_id: str) -> list[int]:
        """The full-attention group's table (what the scheduler's own checks read)."""
        return self.full.live_block_table(request_id)

    def live_group_tables(self, request_id: str) -> tuple[list[int], ...]:
        """The sliding groups' live tables, in group order (for the runner)."""
        return tuple(w.live_block_table(request_id) for w in self.windows)

    def block_states(self) -> bytes:
        tables = [req for g in self._groups for req in g.request_tables]
        return block_states(self._pool.blocks, self._pool.cached.values(), tables,
                            self.block_size)

    def take_events(self) -> list[KVCacheEvent]:
        return self.full.take_events()  # the pool's log: only the full group announces

    def take_copies(self) -> list[BlockCopy]:
        """Every group's copy-on-write instructions (one block id space: the runner
        copies a block in every layer's tensor, the group's own among them)."""
        return [c for g in self._groups for c in g.take_copies()]

    def reset_prefix_cache(self) -> bool:
        return self._pool.reset_prefix_cache()  # refuses while any group holds a block

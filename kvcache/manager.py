"""KVCacheManager: the scheduler's view of the paged KV cache.

Per request it keeps a block table that grows on demand, shares full blocks
between requests through chained prefix hashes, and shares every block
(partial last one included) between a forked parent and child, copying a
shared block on write. Everything here is per block, never per token, except
hashing a block at the moment it becomes full.
"""

from __future__ import annotations

from collections.abc import Sequence

from .block import Block
from .block_hash import BlockHasher, root_hash
from .block_map import block_states
from .block_pool import BlockPool
from .events import KVCacheEvent, KVEventLog
from .records import BlockCopy, CacheStats
from .block_writes import BlockWrites
from .prefix_match import PrefixMatch
from .prefix_pins import PrefixPins
from .window_blocks import WindowBlocks
from .request_blocks import RequestBlocks
from .second_tier import SecondTier


class KVCacheManager(BlockWrites, PrefixMatch, PrefixPins, WindowBlocks):
    """Allocates, shares and frees KV-cache blocks for running requests."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        model_key: str = "",
        kv_events: bool = False,
        sliding_window: int = 0,
        pool: BlockPool | None = None,
        announce: bool = True,
        tier: SecondTier | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Every layer attends to at most this many latest tokens (0: some layer sees
        # the whole context): blocks the window has passed are let go of.
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.model_key = model_key
        # pool: one shared with other layer groups' managers (kvcache/hybrid.py),
        # else its own; kv_events: the pool records what enters and leaves the
        # prefix cache, the blocks this manager registers only if it announces them;
        # tier: where evicted prefix blocks are kept and loaded back from.
        self._pool = pool if pool is not None else BlockPool(
            num_blocks, CacheStats(), KVEventLog(block_size) if kv_events else None, tier)
        self.stats = self._pool.stats
        self._announce = announce
        self._blocks: list[Block] = self._pool.blocks
        self._free_queue = self._pool.free_queue  # .size without a property hop
        self._hasher = BlockHasher(block_size)
        self._requests: dict[str, RequestBlocks] = {}
        self._copies: list[BlockCopy] = []
        # Requests created implicitly (no salt) all share this chain root.
        self._unsalted_root = root_hash(model_key, None)

    # ----------------------------------------------------------- accounting

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached-but-free ones included."""
        return self._pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request."""
        return self._pool.usage

    def num_new_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """Free blocks allocate_slots would take to cover num_total_tokens,
        assuming the new tokens start right after those already in the table."""
        bs = self.block_size
        req = self._requests.get(request_id)
        wanted = -(-num_total_tokens // bs)
        if req is None:
            return wanted
        ids = req.block_ids
        needed = max(0, wanted - len(ids))
        written = req.num_tokens
        partial = written // bs
        # Appending into a shared partly filled block costs one private copy.
        if (
            num_total_tokens > written
            and written % bs
            and partial < len(ids)
            and self._blocks[ids[partial]].ref_count > 1
        ):
            needed += 1
        return needed

    # ------------------------------------------------------- prefix lookup

    def lookup_prefix(
        self,
        request_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        match: bool = True,
        adapter: str | None = None,
    ) -> int:
        """Attach the longest cached prefix of full blocks to a new request.

        Returns the number of tokens covered. At most len(token_ids) - 1 tokens
        are hit (rounded down to whole blocks) because the last prompt token
        must be recomputed to get its logits. The salt is remembered for
        hashing the request's later blocks, even with caching disabled; stats
        count only while caching is enabled. match=False hits nothing (a
        request that needs the logits of every prompt token) but still sets up
        the salt, so the blocks it computes are registered under it. adapter:
        the LoRA adapter the request runs under, a key like the salt (a block
        computed under one adapter is never a hit for another, or for none).
        """
        old = self._requests.get(request_id)
        if old is not None and old.block_ids:
            raise ValueError(f"request {request_id!r} already holds blocks")
        req = RequestBlocks(root_hash(self.model_key, cache_salt, adapter))
        self._requests[request_id] = req
        if not (self.enable_prefix_caching and match):
            return 0
        matched, loads = self._match_cached_blocks(req, token_ids)
        touch = self._pool.touch
        for block in matched:
            touch(block)
            req.block_ids.append(block.block_id)
        if loads:
            self._load_from_tier(req, loads, token_ids)
        hit = len(req.block_ids) * self.block_size
        req.num_tokens = hit
        self.stats.prefix_queries += len(token_ids)
        self.stats.prefix_hits += hit
        return hit

    # ----------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_pending_tokens: int = 0,
    ) -> bool:
        """Cover num_computed_tokens + num_new_tokens tokens; all or nothing.

        Shared blocks this step writes into are first swapped for private copies
        (BlockCopy queued for the runner); blocks that become full are hashed and shared.

        num_lookahead_tokens: slots past the known tokens for speculative drafts.
        They get blocks (private ones) but never hashes: a draft may be rejected,
        so only token_ids, the tokens known to be right, are ever hashed.
        `settle_verified` gives back what the rejected drafts did not need.

        num_pending_tokens: how many of the new tokens are not in token_ids yet
        (async scheduling: sampled by a step still running, fed to this one on the
        device). They are computed like the others, but a block is hashed only once
        every token in it is known, by a later call.
        """
        req = self._requests.get(request_id)
        known = len(token_ids) + num_pending_tokens
        if num_new_tokens == 1 and not num_lookahead_tokens and req is not None \
                and self._append_in_place(req, token_ids, num_computed_tokens, known):
            return True
        end = num_computed_tokens + num_new_tokens
        if num_computed_tokens < 0 or num_new_tokens < 0 or num_lookahead_tokens < 0 \
                or num_pending_tokens < 0 or end > known:
            raise _bad_range(num_computed_tokens, num_new_tokens, known)
        reach = end + num_lookahead_tokens
        self._drop_outside_window(req, num_computed_tokens)
        grow, shared = self._wanted(req, num_computed_tokens, num_new_tokens, reach)
        if grow + len(shared) > self._free_queue.size:
            return False
        if req is None:
            req = self._requests[request_id] = RequestBlocks(self._unsalted_root)
        for index in shared:
            self._copy_on_write(req, index, num_computed_tokens)
        if grow:
            req.block_ids.extend([b.block_id for b in self._pool.allocate(grow)])
        if end > req.num_tokens:
            req.num_tokens = end
        self._hash_known(req, token_ids, end)
        return True

    def blocks_wanted(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                      num_lookahead_tokens: int = 0) -> int:
        """Free blocks allocate_slots would take for these tokens now (blocks the
        window has passed are let go of first): how a hybrid model's layer groups
        check that every group's share fits before any of them allocates."""
        req = self._requests.get(request_id)
        self._drop_outside_window(req, num_computed_tokens)
        grow, shared = self._wanted(req, num_computed_tokens, num_new_tokens,
                                    num_computed_tokens + num_new_tokens + num_lookahead_tokens)
        return grow + len(shared)

    def _wanted(self, req: RequestBlocks | None, computed: int, new: int,
                reach: int) -> tuple[int, Sequence[int]]:
        """(blocks to append, shared blocks to copy first) for a write of `new`
        tokens from `computed`, slots reserved up to `reach`."""
        ids = req.block_ids if req is not None else ()
        grow = max(0, -(-reach // self.block_size) - len(ids))
        return grow, self._shared_writes(req, ids, computed, new, reach)

    # ------------------------------------------------------ fork and free

    def settle_verified(self, request_id: str, token_ids: Sequence[int],
                        num_tokens: int) -> None:
        """After a verification step, KV is right for the first num_tokens of
        token_ids (accepted drafts included) and wrong past them (rejected drafts):
        blocks the accepted drafts filled are hashed now, and blocks holding
        nothing but rejected drafts go back to the pool (never hashed: see
        allocate_slots). The request is then as if it had never seen a draft."""
        req = self._requests.get(request_id)
        if req is None:
            return
        keep = -(-num_tokens // self.block_size)
        extra = req.block_ids[keep:]
        if extra:
            del req.block_ids[keep:]
            blocks = self._blocks
            self._pool.release([blocks[i] for i in reversed(extra)])
        req.num_tokens = num_tokens
        full = num_tokens // self.block_size
        if self.enable_prefix_caching and full > len(req.hashes):
            self._hash_full_blocks(req, token_ids, full)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Child shares every block of the parent, partial last one included."""
        parent = self._requests.get(parent_id)
        if parent is None:
            raise KeyError(f"unknown parent request {parent_id!r}")
        old = self._requests.get(child_id)
        if child_id == parent_id or (old is not None and old.block_ids):
            raise ValueError(f"fork target {child_id!r} already holds blocks")
        child = parent.clone()
        touch = self._pool.touch
        for block_id in child.held:
            touch(self._blocks[block_id])
        self._requests[child_id] = child

    def free(self, request_id: str, num_computed_tokens: int | None = None) -> None:
        """Return all of a request's blocks; no-op for unknown ids.

        num_computed_tokens: how many of its tokens really have KV. Blocks are
        registered for sharing when allocate_slots covers them, before the step
        computes them; a request preempted after it was scheduled in the same
        step (its step taken back) never computes them, so the blocks past that
        point leave the prefix cache instead of serving KV nobody wrote.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if num_computed_tokens is not None:
            self._unregister_from(req, num_computed_tokens)
        # Reverse order: chain tails reach the free queue first, so they are
        # evicted before the parents other prompts are more likely to share.
        blocks = self._blocks
        self._pool.release([blocks[i] for i in reversed(req.held)])

    def uncache(self, request_id: str, num_computed_tokens: int) -> None:
        """The request's blocks past its first num_computed_tokens tokens hold no
        KV after all (the step that was to compute them left it out): they leave
        the prefix cache, so no later request hits them. The request keeps them."""
        req = self._requests.get(request_id)
        if req is not None:
            self._unregister_from(req, num_computed_tokens)

    def _unregister_from(self, req: RequestBlocks, num_computed_tokens: int) -> None:
        for i in range(max(num_computed_tokens // self.block_size, req.num_dropped),
                       len(req.hashes)):
            block = self._blocks[req.block_ids[i]]
            if block.block_hash == req.hashes[i]:  # this request registered it
                self._pool.unregister(block)

    # ----------------------------------------------------------- read-outs

    def block_table(self, request_id: str) -> list[int]:
        """Copy of the request's logical -> physical block ids ([] if unknown)."""
        req = self._requests.get(request_id)
        return list(req.block_ids) if req is not None else []

    def live_block_table(self, request_id: str) -> list[int]:
        """The request's own table, not a copy: read-only for the caller, and only
        until the next call that allocates or frees (the scheduler hands it to the
        runner for the step it just planned)."""
        req = self._requests.get(request_id)
        return req.block_ids if req is not None else []

    @property
    def request_tables(self):
        """Every request's RequestBlocks (read-only: for the engine view's map)."""
        return self._requests.values()

    def live_group_tables(self, request_id: str) -> tuple[list[int], ...]:
        """Other layer groups' tables: none (one group holds every layer; see
        kvcache/hybrid.py for models with more)."""
        return ()

    def block_states(self) -> bytes:
        """One state digit per block (block_map.py), for the live engine view."""
        return block_states(self._blocks, self._pool.cached.values(),
                            self._requests.values(), self.block_size)

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's events since the last call ([] unless kv_events)."""
        return self._pool.events.take() if self._pool.events is not None else []

    def take_copies(self) -> list[BlockCopy]:
        """Pending copy-on-write instructions since the last call; clears them."""
        copies, self._copies = self._copies, []
        return copies

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes. Refuses (returns False, changes nothing)
        while any block is referenced, as vLLM does."""
        # Refusing keeps every request's own hash chain (RequestBlocks.hashes)
        # in step with the pool: only requests without blocks exist after it.
        return self._pool.reset_prefix_cache()


def _bad_range(computed: int, new: int, known: int) -> ValueError:
    return ValueError(f"bad token range: computed={computed} new={new} known={known}")

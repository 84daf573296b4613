"""The sliding-window side of KVCacheManager: leading blocks let go of once every
window the manager serves has passed them, and, for a hybrid model's sliding layer
groups (kvcache/hybrid.py), prefix hits that take only the blocks the window still
reaches."""

from __future__ import annotations

from collections.abc import Sequence

from .block_hash import root_hash
from .request_blocks import DROPPED_BLOCK, RequestBlocks


class WindowBlocks:
    """Mixed into KVCacheManager, whose pool, blocks, hasher, requests, window and
    stats it uses."""

    def _drop_outside_window(self, req: RequestBlocks | None, num_computed_tokens: int) -> None:
        """Let go of the leading blocks no query will read again: every query from
        now on is at a position >= num_computed_tokens and sees keys after
        position - window, so a block ending before num_computed_tokens - window
        is out of every layer's reach. Called where a step needs a new block (once
        a block's worth of tokens), not on the decode fast path. The blocks stay
        in the prefix cache (cached and free) until evicted: a later request's hit
        on them is as good as before."""
        if not self.sliding_window or req is None:
            return
        keep_from = (num_computed_tokens - self.sliding_window) // self.block_size
        if self.enable_prefix_caching:  # a block still to be hashed (tokens pending) stays
            keep_from = min(keep_from, len(req.hashes))
        if keep_from <= req.num_dropped:
            return
        dropped = req.block_ids[req.num_dropped:keep_from]
        blocks = self._blocks
        self._pool.release([blocks[i] for i in reversed(dropped)])
        req.block_ids[req.num_dropped:keep_from] = [DROPPED_BLOCK] * len(dropped)
        req.num_dropped = keep_from
        self.stats.window_dropped += len(dropped)

    def window_chain(self, token_ids: Sequence[int], num_blocks: int,
                     cache_salt: str | None, adapter: str | None
                     ) -> tuple[bytes, list[bytes], list[bool]]:
        """For a sliding-window layer group: (root, the hashes of the first
        num_blocks blocks of token_ids, whether each is cached). Its prefix hit need
        not start at block 0, only cover the window before the first new token
        (kvcache/hybrid.py picks how far, over every group)."""
        root = root_hash(self.model_key, cache_salt, adapter)
        hashes = self._hasher.hash_blocks(root, token_ids, 0, num_blocks)
        cached = self._pool.cached
        return root, hashes, [h in cached for h in hashes]

    def attach_window(self, request_id: str, root: bytes, hashes: list[bytes]) -> None:
        """A new request whose first len(hashes) blocks are hit: the blocks the
        window still reaches from there are taken from the prefix cache (they must
        be in it), those before it are entered as already let go of."""
        if request_id in self._requests and self._requests[request_id].block_ids:
            raise ValueError(f"request {request_id!r} already holds blocks")
        num = len(hashes)
        dropped = self.window_start(num)
        req = RequestBlocks(root, [DROPPED_BLOCK] * dropped, list(hashes),
                            num * self.block_size, dropped)
        lookup, touch = self._pool.lookup, self._pool.touch
        for block_hash in hashes[dropped:]:
            block = lookup(block_hash)
            touch(block)
            req.block_ids.append(block.block_id)
        self._requests[request_id] = req

    def window_start(self, num_blocks: int) -> int:
        """The first block a request with num_blocks blocks computed still reads
        (the rule _drop_outside_window lets go of blocks by)."""
        return max(0, min(num_blocks, (num_blocks * self.block_size - self.sliding_window)
                          // self.block_size))

    def truncate_hit(self, request_id: str, num_blocks: int) -> None:
        """Keep only the first num_blocks blocks of a prefix lookup_prefix just hit
        (another layer group could not hit as far)."""
        req = self._requests[request_id]
        extra = req.block_ids[num_blocks:]
        if not extra:
            return
        del req.block_ids[num_blocks:], req.hashes[num_blocks:]
        blocks = self._blocks
        self._pool.release([blocks[i] for i in reversed(extra)])
        req.num_tokens = num_blocks * self.block_size
        self.stats.prefix_hits -= len(extra) * self.block_size

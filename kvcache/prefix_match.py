"""The read side of KVCacheManager's prefix sharing: a new prompt's hash chain
walked through the cached blocks, then on through the second tier (second_tier.py)
whose blocks come back into new ones instead of being computed again."""

from __future__ import annotations

from collections.abc import Sequence

from .block import Block
from .request_blocks import RequestBlocks


class PrefixMatch:
    """Mixed into KVCacheManager, whose pool, free queue, hasher and stats it uses."""

    def _match_cached_blocks(
        self, req: RequestBlocks, token_ids: Sequence[int]
    ) -> tuple[list[Block], list[bytes]]:
        """Walk the hash chain until the first miss; record hashes of hits. Returns
        the blocks the cache holds, then the hashes of those after them the second
        tier holds (at most as many as there are free blocks to load them into)."""
        bs = self.block_size
        hash_block = self._hasher.hash_block
        lookup = self._pool.lookup
        tier = self._pool.tier
        parent = req.root_hash
        matched: list[Block] = []
        loads: list[bytes] = []
        # Stop hashing at the first miss: a later block can't hit without it.
        for start in range(0, ((len(token_ids) - 1) // bs) * bs, bs):
            parent = hash_block(parent, token_ids[start : start + bs])
            block = lookup(parent) if not loads else None
            if block is None:
                if tier is None or len(loads) >= self._free_queue.size \
                        or not tier.find(parent):
                    break
                loads.append(parent)
            else:
                matched.append(block)
            req.hashes.append(parent)
        return matched, loads

    def _load_from_tier(self, req: RequestBlocks, hashes: list[bytes],
                        token_ids: Sequence[int]) -> None:
        """New blocks for the hashes the second tier holds, as many as are free once
        the cached blocks are taken, registered now (the runner loads them before
        the step that first reads them) and appended to req's table."""
        pool = self._pool
        keep = min(len(hashes), self._free_queue.size)
        if keep < len(hashes):
            del req.hashes[len(req.hashes) - (len(hashes) - keep):]
            hashes = hashes[:keep]
        if not hashes:
            return
        first = len(req.block_ids)
        blocks = pool.allocate(len(hashes))
        bs = self.block_size
        pool.register_all(blocks, hashes, req.hashes[first - 1] if first else None,
                          token_ids[first * bs:(first + len(hashes)) * bs], self._announce)
        for block, block_hash in zip(blocks, hashes):
            pool.tier.load(block_hash, block.block_id)
        req.block_ids.extend(b.block_id for b in blocks)
        self.stats.tier_hits += len(hashes) * self.block_size

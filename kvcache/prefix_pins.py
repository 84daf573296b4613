"""Pins on cached prefix blocks that no request holds: a prefill instance keeps a
finished prompt's blocks for the decode instance that is to read them (engine/
kv_transfer/), and lets go when it has, or when it gave up waiting. A pinned block
is a reference like a request's: never evicted, and back in the prefix cache (free,
still cached) once unpinned."""

from __future__ import annotations

from collections.abc import Sequence

from .block_hash import root_hash


class PrefixPins:
    """Mixed into KVCacheManager, whose pool, hasher and model key it uses."""

    def prompt_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                      adapter: str | None = None) -> list[bytes]:
        """The chained hashes of the prompt's blocks a prefix lookup can hit (full
        ones, the last token's block left out: its logits are always computed)."""
        usable = (len(token_ids) - 1) // self.block_size
        root = root_hash(self.model_key, cache_salt, adapter)
        return self._hasher.hash_blocks(root, token_ids, 0, usable)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many of these chained hashes, from the first, the cache holds now (a
        decode instance need not read those from the prefill's)."""
        if not self.enable_prefix_caching:
            return 0
        count = 0
        while count < len(hashes) and self._pool.lookup(hashes[count]) is not None:
            count += 1
        return count

    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                   adapter: str | None = None) -> list[tuple[int, bytes]]:
        """Pins the prompt's cached blocks, in order up to the first one not cached;
        returns them as (block id, hash). Unpin them with unpin()."""
        hashes = self.prompt_hashes(token_ids, cache_salt, adapter)
        blocks = [self._pool.lookup(h) for h in hashes[:self.cached_prefix(hashes)]]
        for block in blocks:
            self._pool.touch(block)
        return [(block.block_id, h) for block, h in zip(blocks, hashes)]

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Drops pins pin_prefix made (last block first, as a request's are freed,
        so the chain's head is evicted last)."""
        self._pool.release([self._blocks[i] for i in reversed(block_ids)])

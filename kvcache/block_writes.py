"""The write side of KVCacheManager: a step's tokens landing in a request's blocks
(the decode fast path in place, shared blocks copied on write first) and blocks
that became full hashed and offered for prefix sharing."""

from __future__ import annotations

from collections.abc import Sequence

from .records import BlockCopy
from .request_blocks import RequestBlocks


class BlockWrites:
    """Mixed into KVCacheManager, whose pool, blocks, hasher and queued copies it
    uses."""

    def _shared_writes(self, req: RequestBlocks | None, ids: Sequence[int], computed: int,
                       new: int, reach: int) -> Sequence[int]:
        """The request's blocks a write of `new` tokens from `computed` lands in that
        others hold too (each to be copied first). Hot path (decode): the write
        lands in the private last block, so the general scan is skipped unless that
        block is shared or the write reaches back into earlier blocks."""
        first, have = computed // self.block_size, len(ids)
        if new and first < have and (first < have - 1
                                     or self._blocks[ids[first]].ref_count > 1):
            return self._shared_write_targets(req, computed, reach)
        return ()

    def _hash_known(self, req: RequestBlocks, token_ids: Sequence[int], end: int) -> None:
        """Hash the blocks now full below `end` whose tokens are all known."""
        full = min(end, len(token_ids)) // self.block_size
        if full > len(req.hashes) and self.enable_prefix_caching:
            self._hash_full_blocks(req, token_ids, full)

    def append_in_place(self, request_id: str, token_ids: Sequence[int], pos: int,
                        known: int) -> bool:
        """The decode fast path on its own (allocate_slots takes it first): one token
        at `pos` of `known` into the request's private last block; False (nothing
        done) where allocate_slots' general path must decide."""
        req = self._requests.get(request_id)
        return req is not None and self._append_in_place(req, token_ids, pos, known)

    def _append_in_place(self, req: RequestBlocks, token_ids: Sequence[int],
                         pos: int, known: int) -> bool:
        """The decode fast path, taken for almost every request every step: one
        token at `pos` that lands in the request's own last block. False (nothing
        done) when the general path must decide: a new block, a shared block, a
        write behind the last block, or a bad position."""
        ids = req.block_ids
        bs = self.block_size
        if not (0 <= pos < known and pos // bs == len(ids) - 1
                and self._blocks[ids[-1]].ref_count == 1):
            return False
        end = pos + 1
        if end > req.num_tokens:
            req.num_tokens = end
        # A block filled now, or earlier by a multi-token step (accepted drafts) or
        # by a token that was still pending then.
        self._hash_known(req, token_ids, end)
        return True

    def _shared_write_targets(
        self, req: RequestBlocks, start: int, end: int
    ) -> list[int]:
        """Logical indices of existing blocks in [start, end) held by others."""
        bs = self.block_size
        ids = req.block_ids
        blocks = self._blocks
        last = min(len(ids), (end - 1) // bs + 1)
        # Normally this is the one partly filled last block, or nothing.
        return [i for i in range(start // bs, last) if blocks[ids[i]].ref_count > 1]

    def _copy_on_write(self, req: RequestBlocks, index: int, computed: int) -> None:
        """Give the request a private block for logical block ``index``."""
        old = self._blocks[req.block_ids[index]]
        (new,) = self._pool.allocate(1)
        # Slots from `computed` on are about to be overwritten; keep the rest.
        keep = min(computed, req.num_tokens) - index * self.block_size
        if keep > 0:
            keep = min(keep, self.block_size)
            self._copies.append(BlockCopy(old.block_id, new.block_id, keep))
        req.block_ids[index] = new.block_id
        self._pool.release((old,))

    def _hash_full_blocks(
        self, req: RequestBlocks, token_ids: Sequence[int], num_full: int
    ) -> None:
        """Hash blocks that just became full and offer them for sharing."""
        hashes = req.hashes
        first = len(hashes)
        parent = hashes[-1] if hashes else req.root_hash
        new_hashes = self._hasher.hash_blocks(parent, token_ids, first, num_full)
        hashes.extend(new_hashes)
        blocks = self._blocks
        filled = [blocks[i] for i in req.block_ids[first:num_full]]
        if self._pool.events is None or not self._announce:
            self._pool.register_all(filled, new_hashes, announce=self._announce)
        else:  # a chain's first block has no parent block (its root is no block)
            size = self.block_size
            self._pool.register_all(filled, new_hashes, hashes[first - 1] if first else None,
                                    token_ids[first * size:num_full * size])

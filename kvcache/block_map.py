"""The KV cache as a map: one state per physical block, for the live engine view.

Built only when someone asks (a few times a second while the engine page is open),
from the request tables and the hash map the manager already keeps: the work is
proportional to the blocks held and cached, and nothing is tracked per step for it.
States are ASCII digits, ordered by how much they tell, so a coarser map can keep
the largest state of each group of blocks."""

from __future__ import annotations

from collections.abc import Iterable

from .block import Block
from .request_blocks import RequestBlocks

FREE, CACHED, USED, SHARED, COPY_ON_WRITE = b"01234"
# What each state means, for the views above (the same order as the digits).
STATE_NAMES = ("free", "cached", "used", "shared", "copy_on_write")


def block_states(blocks: list[Block], cached: Iterable[Block],
                 requests: Iterable[RequestBlocks], block_size: int) -> bytes:
    """One digit per block:
    FREE: holds nothing worth keeping (reused first);
    CACHED: free but holding a cached prefix, evicted last (a prefix hit revives it);
    USED: in one request's table; SHARED: in several (a shared prefix, or a fork's);
    COPY_ON_WRITE: shared and partly filled, so the next token written copies it."""
    states = bytearray(b"0") * len(blocks)
    for block in cached:
        if block.ref_count == 0:
            states[block.block_id] = CACHED
    for req in requests:
        ids = req.block_ids
        for block_id in req.held:
            states[block_id] = USED if blocks[block_id].ref_count == 1 else SHARED
        last = req.num_tokens // block_size  # the partly filled block, if any
        if req.num_tokens % block_size and last < len(ids) and blocks[ids[last]].ref_count > 1:
            states[ids[last]] = COPY_ON_WRITE
    return bytes(states)

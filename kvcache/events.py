"""What happens to the prefix cache's set of hashes, as vLLM's KV cache events say
it (BlockStored, BlockRemoved, AllBlocksCleared): routers that place requests by
cached prefix rebuild each replica's set from these alone. The block pool records
them as its hash map changes; the engine takes them after each step and publishes
them (engine/core/kv_events.py)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Full blocks became hittable: a run of chained hashes, each covering its
    parent (None: the run starts a prompt's chain), and the runs' token ids."""
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events since the last take(), in order; consecutive removals merged."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, hashes: Sequence[bytes], parent: bytes | None,
               token_ids: Sequence[int]) -> None:
        self._events.append(BlockStored(list(hashes), parent, list(token_ids),
                                        self.block_size))

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

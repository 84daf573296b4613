"""Plain records the manager hands to the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write instruction for the model runner.

    Before the step's forward pass, copy the KV of slots [0, num_tokens) of
    block ``src`` into block ``dst``.
    """

    src: int
    dst: int
    num_tokens: int


@dataclass
class CacheStats:
    """Running prefix-cache counters (never reset by the manager)."""

    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens served from cached blocks
    tier_hits: int = 0  # of those, tokens loaded back from the second tier
    evictions: int = 0  # free blocks whose cached hash was dropped on reuse
    window_dropped: int = 0  # blocks let go of mid-request: every window had passed them

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

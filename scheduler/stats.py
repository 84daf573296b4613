"""What the scheduler tells the engine about its queues and its KV cache: one
snapshot, so nobody above it reads the cache manager or the queues directly."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float  # fraction of the KV cache's blocks in use (0..1)
    # Running totals since start (never reset): the receiver takes differences.
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found cached
    num_preemptions: int
    # The LoRA adapter keys of running and of waiting requests (None: the base model;
    # both empty while the scheduler runs no adapters).
    lora_running: frozenset = frozenset()
    lora_waiting: frozenset = frozenset()
    tier_hits: int = 0  # of the hits, tokens loaded back from the second KV tier

    @staticmethod
    def of(scheduler) -> "SchedulerStats":
        kv, lora = scheduler.kv, scheduler.config.max_loras > 0
        return SchedulerStats(len(scheduler.waiting), len(scheduler.running), kv.num_blocks,
                              kv.num_free_blocks, kv.usage, kv.stats.prefix_queries,
                              kv.stats.prefix_hits, scheduler.num_preemptions,
                              *(frozenset(r.lora for r in q) for q in
                                (scheduler.running, scheduler.waiting) if lora),
                              tier_hits=kv.stats.tier_hits)

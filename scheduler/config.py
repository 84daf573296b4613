"""What the scheduler is built from: its limits and the KV cache it owns."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from kvserve.kvcache import HybridKVCacheManager, KVCacheManager
from kvserve.kvcache.second_tier import SecondTier


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    policy: str = "fcfs"  # fcfs | priority
    # Most tokens one request may compute in a step (0: no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    # Most prompt tokens background requests (batch jobs' lines) compute in a step
    # while an interactive request runs or waits (0: no cap).
    background_prefill_tokens: int = 0
    # Most LoRA adapters among running requests (0: no limit; LoRA off): the
    # adapter slots the model has. A request of another adapter waits for one.
    max_loras: int = 0
    # Pipeline stages: this many steps in flight at once. A request whose sampled
    # token is still on its way sits the steps out until it comes (a stage cannot
    # take a token the last stage has not sampled), and a step seats at most
    # 1/steps_in_flight of the requests, so every step in flight has some.
    steps_in_flight: int = 1


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache the scheduler builds and alone owns (its KVCacheManager)."""
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    model_key: str = ""  # part of every block hash: no hits across models
    # Record what enters and leaves the prefix cache (vLLM's KV cache events), for
    # routers that place requests by the prefixes each replica holds.
    kv_events: bool = False
    # Where every layer of the model attends to at most this many latest tokens:
    # blocks all windows have passed go back to the pool as a request grows. With
    # window_groups, only the sliding-window layers do (a hybrid model: Gemma 2/3,
    # gpt-oss), cut into that many layer groups beside the full-attention layers'
    # (kvcache/hybrid.py).
    sliding_window: int = 0
    window_groups: int = 0

    def manager(self, tier: SecondTier | None = None):
        """The KVCacheManager (or, for a hybrid model, HybridKVCacheManager) of
        these fields; tier: where evicted prefix blocks are kept (one layer group
        only: a hybrid model's caches have none)."""
        fields = asdict(self)
        if not self.window_groups:
            del fields["window_groups"]
            return KVCacheManager(**fields, tier=tier)
        if tier is not None:
            raise ValueError("a second KV tier needs one layer group")
        return HybridKVCacheManager(**fields)

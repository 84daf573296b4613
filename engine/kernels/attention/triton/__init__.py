"""Our Triton kernels for paged attention: the K/V store, attention of query spans
over a cached prefix (prefill chunks, prefix-cache hits), and split-K decoding.
Each wrapper takes torch tensors and launches with fixed configs (no autotuning),
so the same code runs on the GPU and, for tests, in Triton's CPU interpreter."""
from kvserve.engine.kernels.attention.triton.decode import decode_attention, plan_splits
from kvserve.engine.kernels.attention.triton.prefill import prefill_attention
from kvserve.engine.kernels.attention.triton.store import store_kv_cache

__all__ = ["decode_attention", "plan_splits", "prefill_attention", "store_kv_cache"]

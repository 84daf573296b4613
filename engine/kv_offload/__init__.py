"""The second KV tier (kvcache/second_tier.py): prefix blocks the KV cache evicts,
kept in host memory (--kv-offload-bytes) and, past that, on local disk
(--kv-offload-dir), and loaded back into the cache instead of recomputed."""

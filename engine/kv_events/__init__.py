"""KV cache events: the prefix cache's changes published for prefix-aware routers."""

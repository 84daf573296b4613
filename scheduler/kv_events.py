"""The prefix cache's events as the scheduler hands them out (take_kv_events): the
kvcache package's own types, for the layers above, which never import kvcache."""
from kvserve.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent"]

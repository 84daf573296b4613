"""Paged KV-cache bookkeeping: block pool, prefix sharing, copy-on-write.

Pure standard-library Python; the device side only sees block ids and the
BlockCopy instructions returned by KVCacheManager.take_copies().
"""

from .hybrid import HybridKVCacheManager
from .manager import KVCacheManager
from .records import BlockCopy, CacheStats

__all__ = ["BlockCopy", "CacheStats", "HybridKVCacheManager", "KVCacheManager"]

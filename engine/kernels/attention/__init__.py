from kvserve.engine.kernels.attention.backend import AttentionBackend
from kvserve.engine.kernels.attention.context import (AttentionMetadata, clear_attention_context,
                                                      get_attention_metadata, paged_attention,
                                                      prepare_step, set_attention_context)
from kvserve.engine.kernels.attention.selector import (BACKEND_NAMES, AttentionBackendError,
                                                       make_backend, resolve_backend_name)

__all__ = ["AttentionBackend", "AttentionBackendError", "AttentionMetadata", "BACKEND_NAMES",
           "clear_attention_context", "get_attention_metadata", "make_backend",
           "paged_attention", "prepare_step", "resolve_backend_name", "set_attention_context"]

from engine.attention.context import AttentionMetadata, get_attention_metadata, set_attention_metadata

__all__ = ["AttentionMetadata", "get_attention_metadata", "set_attention_metadata"]

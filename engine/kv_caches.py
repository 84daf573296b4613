"""The paged KV cache's tensors on the device: one (K, V) pair per layer, which the
KV cache manager's block ids index. The target model's runner and a draft model
each attach their own."""
from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM


def attach_kv_caches(model: LlamaForCausalLM, num_blocks: int, block_size: int,
                     dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """A paged (K, V) pair per layer, zeroed, and each layer's attention pointed at
    its pair: [(k, v)], each [num_blocks, block_size, kv_heads, head_dim]."""
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device),
               torch.zeros(shape, dtype=dtype, device=device)) for _ in range(cfg.num_layers)]
    for layer, (k, v) in zip(model.layers, caches):
        layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
    return caches

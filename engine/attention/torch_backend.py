"""Reference attention over a paged KV cache with torch ops only: runs anywhere and
is the oracle for faster backends.

The cache of one layer is a pair of tensors [num_blocks, block_size, kv_heads,
head_dim]; flattened over the first two dims a token's K/V lives at its "slot"
(block_id * block_size + offset)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.context import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the step's new tokens. Returns [T, Hq, D]."""
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        out[rows] = _prefill(q[rows], k_flat[span.context_slots],
                             v_flat[span.context_slots], span.mask, scale)
    if meta.decodes is not None:
        d = meta.decodes
        out[d.rows] = _decode(q[d.rows], k_flat[d.context_slots],
                              v_flat[d.context_slots], d.mask, scale)
    return out


def _prefill(q, k, v, mask, scale):
    # [L, H, D] -> [1, H, L, D]; GQA is handled by SDPA's enable_gqa.
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return o.squeeze(0).transpose(0, 1)


def _decode(q, k, v, mask, scale):
    # q: [B, H, D] -> [B, H, 1, D]; k, v: [B, L, Hkv, D] -> [B, Hkv, L, D]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        scale=scale, enable_gqa=q.shape[1] != k.shape[2])
    return o.squeeze(2)

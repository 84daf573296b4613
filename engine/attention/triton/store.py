"""Writes the new tokens' K/V into their cache slots; slot -1 (a padded token) is
skipped."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton.common import check_cache, check_head_layout


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # A padded token is masked out rather than branched around: no control flow.
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & (slot >= 0)
    dst = slot * stride_slot + h * stride_head + d
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T]
    int64 (-1: do not store). One program per token."""
    check_cache(k_cache, v_cache)
    check_head_layout(k, v)
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4)

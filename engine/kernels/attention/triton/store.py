"""Writes the new tokens' K/V into their cache slots; slot -1 (a padded token) is
skipped. Into an fp8 cache, each value divided by its layer's scale and saturated
at +-FP8_MAX, as engine/kernels/fp8_cache.py does with torch ops."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.engine.kernels.fp8_cache import FP8_MAX
from kvserve.engine.kernels.attention.triton.common import (cache_scales, check_cache,
                                                            check_head_layout)


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still in
    fp32. Triton's interpreter converts fp32 to fp8 by rounding half up and drops the
    carry of a mantissa that rounds up to the next power of two (31.9 -> 16); given
    an e4m3 value already, its conversion is exact. The GPU converts in hardware."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of fp32's 23 mantissa bits; a carry runs into the exponent.
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 = ~0xFFFFF
    normal = kept.to(tl.float32, bitcast=True)
    # Below 2**-6, e4m3 is subnormal: multiples of 2**-9. fp32's own addition rounds
    # there, at 1.5 * 2**14 (whose ulp is 2**-9), on |x| so a tiny negative value
    # keeps its sign (-0, as torch's cast gives).
    subnormal = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = tl.where(bits < 0, subnormal * -1.0, subnormal)  # (not 0 - x: +0)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _cache_value(x, scale_ptr, cache_ptr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    if KV_FP8:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        if INTERPRETED:
            x = _round_to_e4m3(x)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
                     v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # A padded token is masked out rather than branched around: no control flow.
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & (slot >= 0)
    dst = slot * stride_slot + h * stride_head + d
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst,
             _cache_value(k, k_scale_ptr, k_cache_ptr, KV_FP8, FP8_MAX, INTERPRETED), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst,
             _cache_value(v, v_scale_ptr, v_cache_ptr, KV_FP8, FP8_MAX, INTERPRETED), mask=mask)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T]
    int64 (-1: do not store); k_scale, v_scale: an fp8 cache's. One program per
    token."""
    check_cache(k_cache, v_cache)
    check_head_layout(k, v)
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_scale, v_scale, fp8 = cache_scales(k_scale, v_scale, k_cache)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        KV_FP8=fp8, FP8_MAX=FP8_MAX, INTERPRETED=k.device.type != "cuda", num_warps=4)

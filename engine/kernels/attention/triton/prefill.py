"""Attention of query spans of any length over a paged context whose earlier part
may already be cached: prefill chunks and prefix-cache hits.

Query i of a request with q_len new tokens and seq_len context tokens sits at
position seq_len - q_len + i and sees keys 0..that position. One program computes
BLOCK_M queries of one request for one query head; it reads only the keys its last
query can see."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.engine.kernels.attention.triton.common import (LOG2E, LOG2E_JIT, cache_scales,
                                                            check_cache,
                                                            check_head_layout, dot_precision,
                                                            dot_tile, upcast_on_load)
from kvserve.engine.kernels.attention.triton.paged_tile import attend_paged, with_sink


def tiles(dtype: torch.dtype, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), chosen by what each compiles to for
    sm_90 and sm_80 (bench/triton_aot_check.py, bench/results/triton_aot_*): from
    head_dim 128 with 8 warps, or a thread's share of Q, K, V and the accumulator
    outgrows its 255 registers (bf16 on sm_80: a spill at 4 warps). 16-bit models in
    64 x 64 tiles; fp32 ones (three tf32 products a dot) in 32 x 32, twice the bytes a
    value, and below head_dim 128 unpipelined (sm_90, block size 32: 12 B spilled);
    past head_dim 128 (latent attention's expanded heads of 192) 16 x 32 unpipelined
    (32 x 32 spilled 692 B on sm_90)."""
    warps = 8 if block_d >= 128 else 4
    if dtype == torch.float32:
        if block_d > 128:
            return 16, 32, warps, 1
        return 32, 32, warps, 2 if block_d >= 128 else 1
    return 64, 64 if block_d <= 128 else 32, warps, 2


# first_req and the table's stride change from step to step: specialised (equal to 1,
# divisible by 16), each value would be a compile of its own mid-serving.
@triton.jit(do_not_specialize=["first_req", "stride_table"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
                    k_scale_ptr, v_scale_ptr, sinks_ptr, scale_log2, first_req, window,
                    softcap,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_block, stride_slot, stride_head, stride_table,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    KV_FP8: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
    tile = tl.program_id(0)
    req = first_req + tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid is sized for the batch's longest span
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - q_len  # keys already in the cache before this step
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    kv_end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    kv_start = 0
    if window > 0:  # keys before the tile's first query's window: skipped
        kv_start = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    acc, l_i, m_i = attend_paged(
        q, prefix + offs_m, kv_start, kv_end,
        block_tables_ptr + req.to(tl.int64) * stride_table, k_cache_ptr, v_cache_ptr,
        head // GROUP, scale_log2, stride_block, stride_slot, stride_head, window, softcap,
        HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, UPCAST, DOT_PRECISION, KV_FP8,
        SOFTCAP)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_JIT
        acc, l_i, m_i = with_sink(acc, l_i, m_i, sink)
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      first_req: int, num_reqs: int, max_query_len: int,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, window: int = 0,
                      softcap: float = 0.0, sinks: torch.Tensor | None = None) -> None:
    """Writes out[rows of requests first_req..first_req+num_reqs-1] (k_scale, v_scale:
    an fp8 cache's; window, softcap, sinks [Hq]: attention/score_mods.py's).

    q, out: [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] already holding these
    tokens' K/V; query_start_loc [R+1], seq_lens [R], block_tables [R, max_blocks],
    all int32. max_query_len: the longest span among these requests."""
    check_cache(k_cache, v_cache)
    check_head_layout(q, out)
    if num_reqs == 0:
        return
    _, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    block_d = dot_tile(head_dim)
    block_m, block_n, warps, stages = tiles(q.dtype, block_d)
    grid = (triton.cdiv(max_query_len, block_m), num_reqs, num_heads)
    k_scale, v_scale, fp8 = cache_scales(k_scale, v_scale, k_cache)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, k_scale, v_scale,
        k_scale if sinks is None else sinks, scale * LOG2E, first_req, window, softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast_on_load(q), DOT_PRECISION=dot_precision(q.dtype), KV_FP8=fp8,
        SOFTCAP=bool(softcap), SINKS=sinks is not None, num_warps=warps, num_stages=stages)

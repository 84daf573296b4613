"""Split-K flash decoding: one query token per request over its paged context.

Stage 1 (grid: requests x kv heads x splits): a program reads one split of one
request's keys for one kv head, once, for all the query heads that share that kv
head (GQA packing: the group's heads are the rows of the tl.dot tile, padded to
16), and writes a partial output and its log-sum-exp per query head.
Stage 2 (grid: requests x query heads): merges the partials by log-sum-exp.

The number of splits is planned on the host (enough programs to fill the GPU for
the longest context the step may hold), but each request divides its own context
among them, on the device: a request of 1,000 keys in a CUDA graph captured for a
128k-token model still spreads over every split it can fill, rather than landing
in the first of a few splits sized for 128k. Splits past a request's end exit at
once. So no step's lengths are needed on the host, and the partials' memory is
bounded by the split count, not by the longest context."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.engine.kernels.attention.triton.common import (LOG2E, LOG2E_JIT, cache_scales,
                                                            check_cache,
                                                            check_head_layout, dot_precision,
                                                            dot_tile, parallelism, upcast_on_load)
from kvserve.engine.kernels.attention.triton.paged_tile import attend_paged

BLOCK_N = 64  # keys per tile: 16-bit models
# fp32 models: twice the bytes a value, three tf32 products a dot; at 64 keys a tile
# their K and V spilled at head_dim 128 on sm_90 (bench/results/triton_aot_*).
BLOCK_N_FP32 = 32
MIN_PARTITION = 256  # fewest keys per split: shorter ones cost more to merge than they save
MAX_SPLITS = 64


@triton.jit
def _first_key(seq_len, window):
    """The first key a request's query sees: 0, or with a sliding window the first
    inside it (keys before it are never read)."""
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)
    return first


@triton.jit
def _request_partition(num_keys, num_splits, min_partition, BLOCK_N: tl.constexpr):
    """Keys per split of one request: the keys it reads over the splits, a multiple
    of BLOCK_N, at least min_partition. The merge computes the same, so both agree
    on how many splits a request fills."""
    per_split = tl.cdiv(num_keys, num_splits)
    return tl.maximum(tl.cdiv(per_split, BLOCK_N) * BLOCK_N, min_partition)


# The split count, the table's stride and the partials' strides (multiples of the
# split count) change from step to step: specialised (equal to 1, divisible by 16),
# each value would be a compile of its own mid-serving.
@triton.jit(do_not_specialize=["num_splits", "stride_table", "stride_lb", "stride_lh"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_lse_ptr,
                         seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
                         scale_log2, num_splits, min_partition, window, softcap,
                         stride_qb, stride_qh, stride_block, stride_slot, stride_head,
                         stride_table, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         KV_FP8: tl.constexpr, SOFTCAP: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    first = _first_key(seq_len, window)
    partition = _request_partition(seq_len - first, num_splits, min_partition, BLOCK_N)
    kv_start = first + split * partition
    if kv_start >= seq_len:  # the merge reads only the splits a request fills
        return
    kv_end = tl.minimum(kv_start + partition, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Past every key: no causal mask, and the window is the range of keys read.
    q_pos = tl.zeros([BLOCK_G], tl.int32) + seq_len
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    acc, l_i, m_i = attend_paged(
        q, q_pos, kv_start, kv_end, block_tables_ptr + req * stride_table,
        k_cache_ptr, v_cache_ptr, kv_head, scale_log2, stride_block, stride_slot,
        stride_head, 0, softcap, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, UPCAST,
        DOT_PRECISION, KV_FP8, SOFTCAP)
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    part = part_out_ptr + req * stride_pb + heads * stride_ph + split * stride_ps
    tl.store(part[:, None] + offs_d[None, :], acc / l_i[:, None], mask=mask)
    lse_ptr = part_lse_ptr + req * stride_lb + heads * stride_lh + split
    tl.store(lse_ptr, m_i + tl.log2(l_i), mask=offs_g < GROUP)


@triton.jit(do_not_specialize=["num_splits", "stride_lb", "stride_lh"])
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, sinks_ptr, num_splits,
                  min_partition, window, stride_pb, stride_ph, stride_ps, stride_lb,
                  stride_lh, stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  SINKS: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    keys = seq_len - _first_key(seq_len, window)
    filled = tl.cdiv(keys, _request_partition(keys, num_splits, min_partition, BLOCK_N))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < filled
    lse = tl.load(part_lse_ptr + req * stride_lb + head * stride_lh + offs_s, mask=s_ok,
                  other=float("-inf"))
    top = tl.max(lse, 0)  # split 0 always has keys: finite
    if SINKS:  # the head's sink logit joins the denominator (base 2)
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_JIT
        top = tl.maximum(top, sink)
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, 0)
    if SINKS:
        total += tl.exp2(sink - top)
    mask = s_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    base = req * stride_pb + head * stride_ph + offs_s * stride_ps
    parts = tl.load(part_out_ptr + base[:, None] + offs_d[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / total
    tl.store(out_ptr + req * stride_ob + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def plan_splits(num_reqs: int, kv_heads: int, max_seq_len: int,
                device: torch.device) -> int:
    """Splits per request and kv head: enough for about two programs per SM, no
    more than the longest context (max_seq_len) fills at MIN_PARTITION keys each,
    at most MAX_SPLITS. Inside a CUDA graph max_seq_len is the model's limit: the
    grid is then sized for it, and shorter contexts fill fewer splits."""
    programs = max(1, num_reqs * kv_heads)
    wanted = triton.cdiv(2 * parallelism(device), programs)
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_seq_len, MIN_PARTITION)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                     scale: float, max_seq_len: int, num_splits: int | None = None,
                     min_partition: int = MIN_PARTITION,
                     k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> None:
    """q, out: [B, Hq, D], one query per request at its last position; seq_lens [B]
    and block_tables [B, max_blocks] int32; max_seq_len: the longest context the
    step may hold (host; the model's limit under capture); num_splits, min_partition:
    overrides of the plan (tests); k_scale, v_scale: an fp8 cache's; window,
    softcap, sinks [Hq]: attention/score_mods.py's."""
    check_cache(k_cache, v_cache)
    check_head_layout(q, out)
    num_reqs, num_heads, head_dim = q.shape
    if num_reqs == 0:
        return
    _, block_size, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    longest = min(max_seq_len, window) if window else max_seq_len  # keys read, at most
    splits = num_splits or plan_splits(num_reqs, kv_heads, longest, q.device)
    block_d = dot_tile(head_dim)
    block_n = BLOCK_N_FP32 if q.dtype == torch.float32 else BLOCK_N
    # fp32 partials: the merge must not round what it weighs.
    part_out = torch.empty(num_reqs, num_heads, splits, head_dim, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_reqs, num_heads, splits, dtype=torch.float32, device=q.device)
    k_scale, v_scale, fp8 = cache_scales(k_scale, v_scale, k_cache)
    _decode_split_kernel[(num_reqs, kv_heads, splits)](
        q, k_cache, v_cache, part_out, part_lse, seq_lens, block_tables, k_scale, v_scale,
        scale * LOG2E, splits, min_partition, window, softcap,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=dot_tile(group),
        BLOCK_N=block_n, BLOCK_D=block_d, UPCAST=upcast_on_load(q),
        DOT_PRECISION=dot_precision(q.dtype), KV_FP8=fp8, SOFTCAP=bool(softcap),
        num_warps=4, num_stages=2)
    _merge_kernel[(num_reqs, num_heads)](
        part_out, part_lse, out, seq_lens, part_lse if sinks is None else sinks, splits,
        min_partition, window,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
        BLOCK_N=block_n, SINKS=sinks is not None, num_warps=4)

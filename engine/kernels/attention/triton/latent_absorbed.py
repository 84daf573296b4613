"""Latent attention absorbed (engine/models/mla.py), on the latent cache itself:
decodes and the prompt chunks too short to expand (latent.py says which).

Every head reads the same cache rows [c, k_rot] (one "KV head"), so a row is loaded
once per tile and used three times: against the heads' latent queries and their
rotary queries for the scores, and as the value. The latent and rotary parts are
tiled apart (DeepSeek's 512 + 64 in tiles of 512 and 64, not one of 1,024: the
generic kernels' power-of-two head tile would double every load and product and
outgrow the shared memory, bench/results/triton_aot_*), and only the latent part of
the output is written: the rest of `out`'s head row is left as it was.

Heads are packed as the rows of the tl.dot tile, BLOCK_H of them a program (all
heads at once would hold 128 x 512 fp32 accumulators). Decodes split each request's
context as the generic decode kernel does (decode.py) and reuse its merge; prompt
chunks pack BLOCK_M // BLOCK_H queries x BLOCK_H heads a program."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.engine.kernels.attention.triton.common import (LOG2E, check_head_layout,
                                                            dot_tile, upcast_on_load)
from kvserve.engine.kernels.attention.triton.decode import (MIN_PARTITION, _merge_kernel,
                                                            _request_partition, plan_splits)
from kvserve.engine.kernels.attention.triton.paged_tile import online_softmax

BLOCK_H = 16  # heads a program (the fewest rows a tl.dot takes on the GPU)


def tiles(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_M, num_warps): keys a tile, (query, head) rows a prompt
    program, and its warps."""
    return (16, 16, 8) if dtype == torch.float32 else (32, 32, 8)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 models' products in full fp32 on the FMA units: at 512 latent values a
    row, tf32x3's split operands spilled 2.4 KB a thread on sm_90 where "ieee" fits
    in 109 registers (bench/triton_aot_check.py). 16-bit dots: the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def attend_latent(q_lat, q_rot, q_pos, kv_start, kv_end, table_ptr, cache_ptr, scale_log2,
                  stride_block, stride_slot, LATENT: tl.constexpr, ROTARY: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Online softmax of rows q_lat [BLOCK_M, BLOCK_L], q_rot [BLOCK_M, BLOCK_R] over
    one request's cache rows kv_start..kv_end-1; key n visible to row m when n <=
    q_pos[m]. Returns (acc [BLOCK_M, BLOCK_L] fp32 unnormalised, l, m in base 2)."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: no (-inf) - (-inf)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = block * stride_block + (offs_n % BLOCK_SIZE) * stride_slot
        # The latents once, [BLOCK_N, BLOCK_L]: scores against their transpose, then
        # the values; the rotary keys loaded transposed, [BLOCK_R, BLOCK_N].
        c = tl.load(cache_ptr + row[:, None] + offs_l[None, :],
                    mask=n_ok[:, None] & (offs_l < LATENT)[None, :], other=0.0)
        r = tl.load(cache_ptr + row[None, :] + LATENT + offs_r[:, None],
                    mask=(offs_r < ROTARY)[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            c = c.to(tl.float32)
            r = r.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_rot, r, acc=s, input_precision=DOT_PRECISION) * scale_log2
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        acc, l_i, m_i = online_softmax(tl.where(visible, s, float("-inf")), c, acc, l_i, m_i,
                                       DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _load_queries(q_ptr, rows, heads, row_ok, stride_qt, stride_qh, LATENT: tl.constexpr,
                  ROTARY: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                  UPCAST: tl.constexpr):
    """(q_lat, q_rot) of the (token row, head) pairs rows x heads."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    base = q_ptr + rows.to(tl.int64) * stride_qt + heads * stride_qh
    q_lat = tl.load(base[:, None] + offs_l[None, :],
                    mask=row_ok[:, None] & (offs_l < LATENT)[None, :], other=0.0)
    q_rot = tl.load(base[:, None] + LATENT + offs_r[None, :],
                    mask=row_ok[:, None] & (offs_r < ROTARY)[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rot = q_rot.to(tl.float32)
    return q_lat, q_rot


# As decode.py's split kernel: the split count, the table's stride and the
# partials' strides change from step to step, never specialised.
@triton.jit(do_not_specialize=["num_splits", "stride_table", "stride_lb", "stride_lh"])
def _latent_decode_kernel(q_ptr, cache_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr,
                          block_tables_ptr, scale_log2, num_splits, min_partition,
                          num_heads, stride_qb, stride_qh, stride_block, stride_slot,
                          stride_table, stride_pb, stride_ph, stride_ps, stride_lb,
                          stride_lh, LATENT: tl.constexpr, ROTARY: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    partition = _request_partition(seq_len, num_splits, min_partition, BLOCK_N)
    kv_start = split * partition
    if kv_start >= seq_len:  # the merge reads only the splits a request fills
        return
    kv_end = tl.minimum(kv_start + partition, seq_len)
    head_ok = heads < num_heads
    q_lat, q_rot = _load_queries(q_ptr, tl.zeros([BLOCK_H], tl.int64) + req, heads, head_ok,
                                 stride_qb, stride_qh, LATENT, ROTARY, BLOCK_L, BLOCK_R,
                                 UPCAST)
    acc, l_i, m_i = attend_latent(
        q_lat, q_rot, tl.zeros([BLOCK_H], tl.int32) + seq_len, kv_start, kv_end,
        block_tables_ptr + req * stride_table, cache_ptr, scale_log2, stride_block,
        stride_slot, LATENT, ROTARY, BLOCK_SIZE, BLOCK_H, BLOCK_N, BLOCK_L, BLOCK_R, UPCAST,
        DOT_PRECISION)
    offs_l = tl.arange(0, BLOCK_L)
    part = part_out_ptr + req * stride_pb + heads * stride_ph + split * stride_ps
    tl.store(part[:, None] + offs_l[None, :], acc / l_i[:, None],
             mask=head_ok[:, None] & (offs_l < LATENT)[None, :])
    tl.store(part_lse_ptr + req * stride_lb + heads * stride_lh + split,
             m_i + tl.log2(l_i), mask=head_ok)


# first_req and the table's stride change from step to step (prefill.py's reasons).
@triton.jit(do_not_specialize=["first_req", "stride_table"])
def _latent_prefill_kernel(q_ptr, cache_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr,
                           block_tables_ptr, scale_log2, first_req, num_heads, stride_qt,
                           stride_qh, stride_ot, stride_oh, stride_block, stride_slot,
                           stride_table, LATENT: tl.constexpr, ROTARY: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                           UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M // BLOCK_H
    tile = tl.program_id(0)
    req = first_req + tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if tile * BLOCK_Q >= q_len:  # the grid is sized for the longest chunk
        return
    prefix = tl.load(seq_lens_ptr + req) - q_len  # keys cached before this step
    offs_m = tl.arange(0, BLOCK_M)
    query = tile * BLOCK_Q + offs_m // BLOCK_H  # row m: query m // BLOCK_H, head m % BLOCK_H
    heads = tl.program_id(2) * BLOCK_H + offs_m % BLOCK_H
    row_ok = (query < q_len) & (heads < num_heads)
    q_lat, q_rot = _load_queries(q_ptr, q_start + query, heads, row_ok, stride_qt,
                                 stride_qh, LATENT, ROTARY, BLOCK_L, BLOCK_R, UPCAST)
    kv_end = tl.minimum(prefix + q_len, prefix + (tile + 1) * BLOCK_Q)
    acc, l_i, _ = attend_latent(
        q_lat, q_rot, prefix + query, 0, kv_end,
        block_tables_ptr + req.to(tl.int64) * stride_table, cache_ptr, scale_log2,
        stride_block, stride_slot, LATENT, ROTARY, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_L,
        BLOCK_R, UPCAST, DOT_PRECISION)
    offs_l = tl.arange(0, BLOCK_L)
    out = out_ptr + (q_start + query).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out[:, None] + offs_l[None, :], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_l < LATENT)[None, :])


def _check(q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor, latent: int) -> None:
    if not (cache.is_contiguous() and cache.dim() == 4 and cache.shape[2] == 1):
        raise ValueError("the latent cache must be one contiguous [blocks, block_size, 1, "
                         "latent + rotary] tensor")
    if q.shape[-1] != cache.shape[-1] or out.shape[-1] < latent:
        raise ValueError(f"queries of width {q.shape[-1]} over cache rows of "
                         f"{cache.shape[-1]}, output of {out.shape[-1]} (latent {latent})")
    check_head_layout(q, out)


def latent_decode(q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                  latent: int, max_seq_len: int, num_splits: int | None = None,
                  min_partition: int = MIN_PARTITION) -> None:
    """out[b, h, :latent] = attention of q [B, H, latent + rotary] (one query a
    request, at its last position) over its cache rows, in latent space; seq_lens
    [B], block_tables [B, max_blocks] int32; max_seq_len, num_splits, min_partition:
    as decode_attention's."""
    _check(q, cache, out, latent)
    num_reqs, num_heads, width = q.shape
    if num_reqs == 0:
        return
    groups = triton.cdiv(num_heads, BLOCK_H)
    splits = num_splits or plan_splits(num_reqs, groups, max_seq_len, q.device)
    block_n, _, warps = tiles(q.dtype)
    part_out = torch.empty(num_reqs, num_heads, splits, latent, dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty(num_reqs, num_heads, splits, dtype=torch.float32, device=q.device)
    _latent_decode_kernel[(num_reqs, groups, splits)](
        q, cache, part_out, part_lse, seq_lens, block_tables, scale * LOG2E, splits,
        min_partition, num_heads, q.stride(0), q.stride(1), cache.stride(0),
        cache.stride(1), block_tables.stride(0), part_out.stride(0), part_out.stride(1),
        part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        LATENT=latent, ROTARY=width - latent, BLOCK_SIZE=cache.shape[1], BLOCK_H=BLOCK_H,
        BLOCK_N=block_n, BLOCK_L=dot_tile(latent), BLOCK_R=dot_tile(width - latent),
        UPCAST=upcast_on_load(q), DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps,
        num_stages=2)
    _merge_kernel[(num_reqs, num_heads)](
        part_out, part_lse, out, seq_lens, part_lse, splits, min_partition, 0,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=latent, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=dot_tile(latent),
        BLOCK_N=block_n, SINKS=False, num_warps=4)


def latent_prefill(q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_tables: torch.Tensor, scale: float, latent: int, first_req: int,
                   num_reqs: int, max_query_len: int) -> None:
    """out[rows of requests first_req..first_req+num_reqs-1, :, :latent]: their
    prompt chunks' attention in latent space, over caches already holding them.
    q [T, H, latent + rotary]; query_start_loc [R+1], seq_lens [R], block_tables
    [R, max_blocks] int32; max_query_len: the longest of these chunks."""
    _check(q, cache, out, latent)
    if num_reqs == 0:
        return
    num_heads, width = q.shape[1:]
    block_n, block_m, warps = tiles(q.dtype)
    grid = (triton.cdiv(max_query_len, block_m // BLOCK_H), num_reqs,
            triton.cdiv(num_heads, BLOCK_H))
    _latent_prefill_kernel[grid](
        q, cache, out, query_start_loc, seq_lens, block_tables, scale * LOG2E, first_req,
        num_heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0),
        cache.stride(1), block_tables.stride(0),
        LATENT=latent, ROTARY=width - latent, BLOCK_SIZE=cache.shape[1],
        BLOCK_M=block_m, BLOCK_H=BLOCK_H, BLOCK_N=block_n, BLOCK_L=dot_tile(latent),
        BLOCK_R=dot_tile(width - latent), UPCAST=upcast_on_load(q),
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=warps, num_stages=2)

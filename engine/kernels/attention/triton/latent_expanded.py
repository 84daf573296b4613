"""Latent attention's long prompt chunks expanded on the Triton path
(engine/kernels/attention/latent.py says when), as vLLM's MLA prefill does: the
chunks' context blocks gathered from the latent cache, every head's keys [W_UK c,
k_rot] and values W_UV c made by one GEMM over them, and the prefill kernel run over
those as an ordinary paged cache with one KV head per query head.

The scratch cache keeps the engine's block size and each request's blocks in
order, so the prefill kernel reads it through a block table of its own and sees
the same positions, prefix and causal mask as on the latent cache itself. Values
are zero-padded to the keys' width (the kernel reads K and V of one shape)."""
from __future__ import annotations

import torch

from kvserve.engine.kernels.attention.triton.prefill import prefill_attention


def expanded_prefill(q: torch.Tensor, q_nope: torch.Tensor, cache: torch.Tensor,
                     out: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor,
                     runs: list[tuple[int, int, int]], host_starts: list[int],
                     host_seq_lens: list[int], scale: float, kv_b: torch.Tensor) -> None:
    """Writes out[rows of the runs' requests] [T, H, v]: attention in value space.

    q [T, H, latent + rotary] (its rotary part read), q_nope [T, H, nope]; cache
    [blocks, block_size, 1, latent + rotary] already holding this step's rows;
    query_start_loc, seq_lens, block_tables: the step's device metadata; runs:
    (first request, request count, longest chunk) of consecutive expanded requests;
    host_starts, host_seq_lens: query_start_loc and seq_lens on the host. kv_b [H x
    (nope + v), latent]: each head's W_UK rows, then its W_UV rows."""
    heads, latent = q.shape[1], kv_b.shape[1]
    rotary, nope = q.shape[-1] - latent, q_nope.shape[-1]
    v = kv_b.shape[0] // heads - nope
    block_size = cache.shape[1]
    requests = [r for first, count, _ in runs for r in range(first, first + count)]
    counts = [-(-host_seq_lens[r] // block_size) for r in requests]
    sources = torch.cat([block_tables[r, :n] for r, n in zip(requests, counts)]).long()
    rows = cache.index_select(0, sources).view(-1, cache.shape[-1])  # [N, L + R]
    kv = (rows[:, :latent] @ kv_b.t()).view(-1, heads, nope + v)
    width = nope + rotary
    keys = torch.empty(rows.shape[0], heads, width, dtype=q.dtype, device=q.device)
    keys[..., :nope] = kv[..., :nope]
    keys[..., nope:] = rows[:, None, latent:]
    values = torch.zeros_like(keys)
    values[..., :v] = kv[..., nope:]
    scratch = (keys.view(-1, block_size, heads, width),
               values.view(-1, block_size, heads, width))
    tables = torch.zeros(block_tables.shape[0], max(counts), dtype=torch.int32)
    first_block = 0
    for r, n in zip(requests, counts):
        tables[r, :n] = torch.arange(first_block, first_block + n, dtype=torch.int32)
        first_block += n
    tables = tables.to(q.device, non_blocking=True)
    query = torch.cat((q_nope, q[..., latent:]), dim=-1)  # [T, H, nope + R]
    o = torch.empty_like(query)
    for first, count, longest in runs:
        prefill_attention(query, *scratch, o, query_start_loc, seq_lens, tables, scale,
                          first_req=first, num_reqs=count, max_query_len=longest)
    for r in requests:
        span = slice(host_starts[r], host_starts[r + 1])
        out[span] = o[span, :, :v]

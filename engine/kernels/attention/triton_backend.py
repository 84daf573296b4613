"""Attention through our Triton kernels (engine/kernels/attention/triton/): the store, then
the split-K decode kernel for the decodes (rows 0..B-1) and the prefix-aware
prefill kernel for every longer span, each over the paged cache. Latent attention
(DeepSeek) has kernels of its own over the latent cache (triton/latent_absorbed.py),
its long prompt chunks expanded per head (triton/latent_expanded.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.kernels.attention.backend import AttentionBackend
from kvserve.engine.kernels.attention.context import AttentionMetadata
from kvserve.engine.kernels.attention.latent import LatentShape
from kvserve.engine.kernels.attention.triton import (decode_attention, prefill_attention,
                                                     store_kv_cache)
from kvserve.engine.kernels.attention.triton.latent_absorbed import (latent_decode,
                                                                      latent_prefill)
from kvserve.engine.kernels.attention.triton.latent_expanded import expanded_prefill


@dataclass
class TritonAttentionMetadata:
    common: AttentionMetadata
    # The longest context the decodes may hold (the model's limit in a CUDA graph):
    # sizes the decode kernel's split grid, each request dividing its own context
    # among the splits on the device; 0 without decodes.
    max_decode_seq_len: int


class TritonBackend(AttentionBackend):
    name = "triton"

    graph_safe = True  # prepare reads no device data; forward only launches kernels

    def prepare(self, common: AttentionMetadata) -> TritonAttentionMetadata:
        nd = common.num_decodes
        if common.seq_lens_cpu is None:  # a CUDA graph: plan for any context length
            longest = common.max_seq_len if nd else 0
        else:
            longest = int(common.seq_lens_cpu[:nd].max()) if nd else 0
        return TritonAttentionMetadata(common, longest)

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonAttentionMetadata, scale,
                k_scale=None, v_scale=None, window=0, softcap=0.0, sinks=None):
        mods = dict(window=window, softcap=softcap, sinks=sinks)
        c = meta.common
        store_kv_cache(k, v, k_cache, v_cache, c.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(q)
        nd = c.num_decodes
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, out[:nd], c.seq_lens[:nd],
                             c.block_tables[:nd], scale, meta.max_decode_seq_len,
                             k_scale=k_scale, v_scale=v_scale, **mods)
        if c.num_prefills:
            prefill_attention(q, k_cache, v_cache, out, c.query_start_loc, c.seq_lens,
                              c.block_tables, scale, first_req=nd, num_reqs=c.num_prefills,
                              max_query_len=c.max_query_len, k_scale=k_scale,
                              v_scale=v_scale, **mods)
        return out

    def latent_attention(self, q, q_nope, entry, cache, meta: TritonAttentionMetadata,
                         scale, kv_b, nope):
        """kvserve::latent_attention (latent.py): decodes and short prompt chunks
        absorbed (triton/latent_absorbed.py), long chunks expanded per head
        (triton/latent_expanded.py). The absorbed output's rotary part is left
        unwritten (the layer reads the latent part)."""
        c = meta.common
        shape = LatentShape.of(q, kv_b, nope)
        store_kv_cache(entry, entry, cache, cache, c.slot_mapping)
        absorbed = torch.empty_like(q)
        expanded = q.new_zeros(q.shape[0], shape.heads, shape.v)
        nd = c.num_decodes
        if nd:
            latent_decode(q[:nd], cache, absorbed[:nd], c.seq_lens[:nd], c.block_tables[:nd],
                          scale, shape.latent, meta.max_decode_seq_len)
        if not c.num_prefills:
            return absorbed, expanded
        starts = c.query_start_loc_cpu.tolist()
        prefills = range(nd, nd + c.num_prefills)
        q_lens = [starts[r + 1] - starts[r] for r in prefills]
        seq_lens = c.seq_lens_cpu.tolist()
        chosen = shape.expanded(q_lens, [seq_lens[r] for r in prefills], q.element_size())
        long = []
        for run, expand in _runs(nd, q_lens, chosen):
            if expand:
                long.append(run)
            else:
                latent_prefill(q, cache, absorbed, c.query_start_loc, c.seq_lens,
                               c.block_tables, scale, shape.latent, *run)
        if long:
            expanded_prefill(q, q_nope, cache, expanded, c.query_start_loc, c.seq_lens,
                             c.block_tables, long, starts, seq_lens, scale, kv_b)
            for first, count, _ in long:
                absorbed[starts[first]:starts[first + count]] = 0
        return absorbed, expanded


def _runs(first: int, q_lens: list[int], chosen: list[bool]
          ) -> list[tuple[tuple[int, int, int], bool]]:
    """The prompt chunks (requests first, first + 1, ...) cut into runs of
    consecutive requests alike in `chosen`: ((first request, count, longest chunk),
    flag) each, so each run is one kernel launch."""
    runs: list[tuple[tuple[int, int, int], bool]] = []
    for i, (q_len, flag) in enumerate(zip(q_lens, chosen)):
        if runs and runs[-1][1] == flag:
            (start, count, longest), _ = runs[-1]
            runs[-1] = ((start, count + 1, max(longest, q_len)), flag)
        else:
            runs.append(((first + i, 1, q_len), flag))
    return runs

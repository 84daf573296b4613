"""Attention through our Triton kernels (engine/kernels/attention/triton/): the store, then
the split-K decode kernel for the decodes (rows 0..B-1) and the prefix-aware
prefill kernel for every longer span, each over the paged cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.kernels.attention.backend import AttentionBackend
from kvserve.engine.kernels.attention.context import AttentionMetadata
from kvserve.engine.kernels.attention.triton import (decode_attention, prefill_attention,
                                                     store_kv_cache)


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

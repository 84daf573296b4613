"""Attention through flash-attn 2 (imported only when this backend is chosen):
`flash_attn_with_kvcache` when every request decodes, else `flash_attn_varlen_func`
over the whole batch with the block table. Both align the causal mask to the end of
the context, which is our "query i sits at seq_len - q_len + i". New K/V are
stored by our Triton store kernel first. Needs CUDA, fp16/bf16 and a block size
that is a multiple of 256 (checked by the selector)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.engine.kernels.attention.backend import AttentionBackend
from kvserve.engine.kernels.attention.context import AttentionMetadata


@dataclass
class FlashAttnMetadata:
    common: AttentionMetadata
    cu_seqlens_k: torch.Tensor  # [R + 1] int32 prefix sums of seq_lens


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from kvserve.engine.kernels.attention.triton import store_kv_cache

        self._varlen, self._with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache
        self._store = store_kv_cache

    def prepare(self, common: AttentionMetadata) -> FlashAttnMetadata:
        cu = F.pad(torch.cumsum(common.seq_lens, 0, dtype=torch.int32), (1, 0))
        return FlashAttnMetadata(common, cu)

    def forward(self, q, k, v, k_cache, v_cache, meta: FlashAttnMetadata, scale,
                k_scale=None, v_scale=None, window=0, softcap=0.0, sinks=None):
        if k_scale is not None:  # the selector refuses the pairing; a cache is never misread
            raise ValueError("the flash-attn backend reads no fp8 KV cache")
        if sinks is not None:  # likewise (engine/core/build.py)
            raise ValueError("flash-attn 2 has no attention sinks")
        # flash-attn's window counts the keys left of the query's own.
        extras = dict(window_size=(window - 1, 0) if window else (-1, -1), softcap=softcap)
        c = meta.common
        self._store(k, v, k_cache, v_cache, c.slot_mapping)
        if c.num_prefills == 0:
            out = torch.empty_like(q)
            nd = c.num_decodes
            # [B, 1, Hq, D]: one query per request, at the end of its context.
            out[:nd] = self._with_kvcache(
                q[:nd].unsqueeze(1), k_cache, v_cache, cache_seqlens=c.seq_lens,
                block_table=c.block_tables, softmax_scale=scale, causal=True,
                **extras).squeeze(1)
            return out
        return self._varlen(
            q, k_cache, v_cache, cu_seqlens_q=c.query_start_loc,
            cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=c.max_query_len,
            max_seqlen_k=c.max_seq_len, softmax_scale=scale, causal=True,
            block_table=c.block_tables, **extras)

"""The CPU library's ops' output shapes for torch.compile's and torch.export's tracing
(registered once the library that defines them is loaded: engine/weights/
cpu_packing.load_once)."""
from __future__ import annotations

import torch


def register_fake() -> None:
    @torch.library.register_fake("kvserve::packed_linear")
    def _(x, weight, n, bias, scales=None, mins=None, int8_inputs=False):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kvserve::bf16_linear")
    def _(x, weight, n, bias):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kvserve::expert_linear")
    def _(x, counts, weight, scales=None, mins=None, int8_inputs=False):
        return x.new_empty((x.shape[0], weight.shape[1]))

    # Where more rows meet the experts than it takes, it returns an empty 1-D tensor
    # instead (fused_experts then takes the call): met only eagerly. A compiled graph
    # calls it for one token (fused_experts.one_token_moe_experts), which it takes.
    @torch.library.register_fake("kvserve::moe_experts")
    def _(x, topk_ids, topk_weights, w13, w2, first, w13_scale=None, w2_scale=None,
          w13_min=None, w2_min=None, int8_inputs=False, max_rows=6):
        return torch.empty_like(x)

    @torch.library.register_fake("kvserve::paged_decode")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("kvserve::paged_prefill")
    def _(q, k_cache, v_cache, block_table, ctx_len, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention, and on the sparse layers
(decoder_sparse_step, mlp_only_layers) a mixture of experts, Qwen2-MoE's with a
gated shared expert. Their checkpoints name each expert's projections
mlp.experts.{e}.{gate,up,down}_proj, the layout DecoderModel reads by default: what
is particular to the family is in its config (engine/config/moe_config.py)."""
from __future__ import annotations

from kvserve.engine.models.decoder import DecoderModel


class QwenMoeForCausalLM(DecoderModel):
    pass

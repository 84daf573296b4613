"""DeepSeek-V2 and DeepSeek-V3 (and Kimi-K2, V3's shape): latent attention
(engine/models/mla.py) in every layer, a dense MLP in the first first_k_dense_replace
layers and a mixture of experts after them, routed by grouped top-k with a shared
expert beside (engine/models/moe.py): V3's over sigmoid scores with a correction
bias, V2's over softmax scores. V2's rope rotates interleaved pairs as V3's does; it
keeps them paired where we lay them out evens-then-odds, a permutation applied to
queries and keys alike, so every score is the same."""
from __future__ import annotations

from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.models.decoder import DecoderLayer, DecoderModel
from kvserve.engine.models.layers import RMSNorm
from kvserve.engine.models.mla import MLAttention
from kvserve.engine.models.tp_shard import TPShard


class DeepseekV3ForCausalLM(DecoderModel):
    @classmethod
    def make_layer(cls, cfg: ModelConfig, layer: int, shard: TPShard) -> nn.Module:
        decoder = DecoderLayer(cfg, cls.make_mlp(cfg, layer, shard), layer, shard, RMSNorm)
        decoder.self_attn = MLAttention(cfg, layer, shard)
        return decoder


    @classmethod
    def checkpoint_name(cls, ckpt_name: str):
        name = ckpt_name.removeprefix("model.").replace(".shared_experts.", ".shared_expert.")
        name = name.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")
        if ".self_attn." in name:
            return name, None  # MLA's projections are its own, none packed
        return super().checkpoint_name(name)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    pass

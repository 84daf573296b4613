"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention, and on the sparse layers
(decoder_sparse_step, mlp_only_layers) a mixture of experts, Qwen2-MoE's with a
gated shared expert. Checkpoints name each expert's projections
mlp.experts.{e}.{gate,up,down}_proj."""
from __future__ import annotations

import re

from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.models.decoder import DecoderModel
from kvserve.engine.models.moe import SparseMoE
from kvserve.engine.models.tp_shard import TPShard

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
_BIASES = {"w13": "b13", "w2": "b2"}


def expert_name(name: str, parts: dict[str, tuple[str, int]] = _PARTS,
                pattern: re.Pattern = _EXPERT) -> tuple[str, tuple[int, int]] | None:
    """`...experts.{e}.{projection}.{weight,bias}` -> (our stacked parameter,
    (e, part))."""
    m = pattern.match(name)
    if m is None:
        return None
    attr, part = parts[m.group(3)]
    if m.group(4) == "bias":
        attr = _BIASES[attr]
    return f"{m.group(1)}.{attr}", (int(m.group(2)), part)


class QwenMoeForCausalLM(DecoderModel):
    @classmethod
    def make_mlp(cls, cfg: ModelConfig, layer: int, shard: TPShard) -> nn.Module:
        if cfg.moe.is_sparse(layer):
            return SparseMoE(cfg, layer, shard)
        return super().make_mlp(cfg, layer, shard)

    @classmethod
    def checkpoint_name(cls, ckpt_name: str):
        return expert_name(ckpt_name.removeprefix("model.")) or super().checkpoint_name(ckpt_name)

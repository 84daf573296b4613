"""The dense SwiGLU MLP (a decoder layer's, or a mixture-of-experts layer's shared
expert): gate and up in one packed projection, then down."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.models.layers import PackedLinear
from kvserve.engine.models.lora_step import LoRAStep
from kvserve.engine.models.tp_layers import RowParallelLinear
from kvserve.engine.models.tp_shard import SINGLE, TPShard


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # Gemma's
    "gelu": F.gelu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; kvserve has "
                         f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """intermediate_size: the whole model's (default: the config's), split here over
    the tensor-parallel ranks."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, shard: TPShard = SINGLE,
                 intermediate_size: int | None = None):
        super().__init__()
        self.layer = layer
        self.act = activation(cfg.hidden_act)
        inter = shard.split(intermediate_size or cfg.intermediate_size)
        self.gate_up_proj = PackedLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LoRAStep | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        gate, up = lora.add("gate_up", self.layer, x, gate_up).chunk(2, dim=-1)
        h = self.act(gate) * up
        return lora.add("down", self.layer, h, self.down_proj(h))

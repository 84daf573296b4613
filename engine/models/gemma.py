"""Gemma 2 and Gemma 3 (text): the decoder with Gemma's differences. Its RMSNorm
scales by (1 + w), in float32; each layer norms the attention's and the MLP's
outputs too (four norms a layer); the embedding is scaled by sqrt(hidden); the MLP
gates with tanh-approximated GELU; scores are scaled by query_pre_attn_scalar, and
sliding and full layers alternate (layer_types). Gemma 2 soft-caps attention scores
and logits; Gemma 3 has QK-norm and a rope base of its own for sliding layers."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.kernels.attention.cpu_paged import PagedDecode
from kvserve.engine.models.attention import Attention
from kvserve.engine.models.decoder import DecoderModel
from kvserve.engine.models.lora_step import LoRAStep
from kvserve.engine.models.tp_shard import TPShard


class GemmaRMSNorm(nn.Module):
    weight_offset = 1.0  # scales by (1 + weight): random weights start it at 0

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module, layer: int, shard: TPShard):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Attention(cfg, layer, shard, GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, ropes, x: torch.Tensor, paged: PagedDecode | None = None,
                lora: LoRAStep | None = None) -> torch.Tensor:
        rope = ropes[self.self_attn.rope_index]
        attn = self.self_attn(rope, self.input_layernorm(x), paged, lora)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x), lora)
        return x + self.post_feedforward_layernorm(mlp)


class GemmaForCausalLM(DecoderModel):
    norm_class = GemmaRMSNorm

    @classmethod
    def make_layer(cls, cfg: ModelConfig, layer: int, shard: TPShard) -> nn.Module:
        return GemmaDecoderLayer(cfg, cls.make_mlp(cfg, layer, shard), layer, shard)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype first, as transformers does
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

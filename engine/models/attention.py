"""Grouped-query self-attention over the paged KV cache (Llama, Mistral, Qwen and
their mixture-of-experts variants): q/k/v in one packed projection, optional
QK-norm, rotary embeddings, then the step's attention backend."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.kernels.attention import paged_attention
from kvserve.engine.kernels.attention.cpu_paged import PagedDecode, decode_in_place
from kvserve.engine.kernels.fp8_cache import rotate
from kvserve.engine.models.layers import PackedLinear, RMSNorm
from kvserve.engine.models.lora_step import LoRAStep
from kvserve.engine.models.rotary import apply_rotary
from kvserve.engine.models.tp_layers import RowParallelLinear
from kvserve.engine.models.tp_shard import SINGLE, TPShard


class Attention(nn.Module):
    """The heads one tensor-parallel rank holds (`shard`; all of them at one rank)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, shard: TPShard = SINGLE,
                 norm: type[nn.Module] = RMSNorm):
        """norm: the QK-norm's class, where the config has one."""
        super().__init__()
        self.layer = layer  # which adapter weights a LoRA step adds here
        self.num_heads, self.num_kv_heads = shard.heads(cfg), shard.kv_heads(cfg)
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.qkv_bias)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        # What some families add to the softmax (engine/kernels/attention/score_mods.py).
        self.window, self.softcap = cfg.window(layer), cfg.attn_softcap
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
        # Which of the model's rope tables this layer rotates by (1: the local one of
        # sliding layers, Gemma 3).
        self.rope_index = 1 if cfg.local_rope is not None and self.window else 0
        # Set by the model runner once the cache is allocated.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # An fp8 cache's (k_scale, v_scale) and key rotation, set with it (kv_caches.py).
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.key_rotation: torch.Tensor | None = None
        # The layer group whose block tables this layer's cache is read by (a hybrid
        # model's sliding layers: kvcache/hybrid.py), set with the cache.
        self.kv_group = 0

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                paged: PagedDecode | None = None, lora: LoRAStep | None = None
                ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.add("qkv", self.layer, x, qkv)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.key_rotation is not None:  # q.k unchanged: the rotation is orthogonal
            q, k = rotate(q, self.key_rotation), rotate(k, self.key_rotation)
        k_scale, v_scale = self.kv_scales or (None, None)
        mods = (self.window, self.softcap, self.sinks)
        if paged is None:  # the attention custom op, through the step's backend
            o = paged_attention(q, k, v, self.k_cache, self.v_cache, self.scale,
                                k_scale, v_scale, *mods, self.kv_group)
        else:  # a compiled decode graph: attention traced with the rest
            o = decode_in_place(q, k, v, self.k_cache, self.v_cache,
                                paged.of_group(self.kv_group), self.scale,
                                k_scale, v_scale, *mods)
        o = o.reshape(n, q_size)
        out = self.o_proj(o)
        return out if lora is None else lora.add("o", self.layer, o, out)

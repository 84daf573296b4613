"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

There is no padding and no batch dimension: row i of every activation is token i of
the step, whatever request it belongs to. Attention is the only place requests are
told apart, through the global attention metadata and the paged KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.kernels.attention import paged_attention
from kvserve.engine.kernels.attention.cpu_paged import PagedDecode, decode_in_place
from kvserve.engine.kernels.fp8_cache import rotate
from kvserve.engine.models import tp_comm as comm
from kvserve.engine.models.layers import PackedLinear, RMSNorm, RotaryEmbedding, apply_rotary
from kvserve.engine.models.linear import Linear
from kvserve.engine.models.lora_step import LoRAStep
from kvserve.engine.models.tp_layers import RowParallelLinear, VocabParallelEmbedding
from kvserve.engine.models.tp_shard import SINGLE, TPShard


class Attention(nn.Module):
    """The heads one tensor-parallel rank holds (`shard`; all of them at one rank)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, shard: TPShard = SINGLE):
        super().__init__()
        self.layer = layer  # which adapter weights a LoRA step adds here
        self.num_heads, self.num_kv_heads = shard.heads(cfg), shard.kv_heads(cfg)
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.qkv_bias)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        # Set by the model runner once the cache is allocated.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # An fp8 cache's (k_scale, v_scale) and key rotation, set with it (kv_caches.py).
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.key_rotation: torch.Tensor | None = None

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
        if paged is None:  # the attention custom op, through the step's backend
            o = paged_attention(q, k, v, self.k_cache, self.v_cache, self.scale,
                                k_scale, v_scale)
        else:  # a compiled decode graph: attention traced with the rest
            o = decode_in_place(q, k, v, self.k_cache, self.v_cache, paged, self.scale,
                                k_scale, v_scale)
        o = o.reshape(n, q_size)
        out = self.o_proj(o)
        return out if lora is None else lora.add("o", self.layer, o, out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0, shard: TPShard = SINGLE):
        super().__init__()
        self.layer = layer
        inter = shard.intermediate(cfg)
        self.gate_up_proj = PackedLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, lora: LoRAStep | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate, up = lora.add("gate_up", self.layer, x, gate_up).chunk(2, dim=-1)
        h = F.silu(gate) * up
        return lora.add("down", self.layer, h, self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0, shard: TPShard = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer, shard)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                paged: PagedDecode | None = None, lora: LoRAStep | None = None
                ) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), paged, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our packed module name fragment, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int, shard: TPShard = SINGLE):
        super().__init__()
        self.config = cfg  # the whole model's, whatever part of it `shard` holds
        self.shard = shard
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.embed_tokens = VocabParallelEmbedding(shard.vocab(cfg), cfg.hidden_size,
                                                   shard.vocab_start(cfg))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, shard.vocab(cfg), bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                num_layers: int | None = None, paged: PagedDecode | None = None,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (logits are taken only for the
        rows that need them, see compute_logits). num_layers: stop after that many
        layers and normalise there (early-exit drafts: the first layers plus the
        LM head make a draft model with no weights of its own). paged: a decode-only
        step's attention inputs, for attention written as plain ops (compiled decode
        graphs on CPU); without it every layer calls the attention custom op.
        lora: the step's adapters (engine/models/lora_step.py), None when it has none."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions, x.dtype)
        # (Slicing a ModuleList builds a new one: only when asked.)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer in layers:
            x = layer(rope, x, paged, lora)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [rows, vocab] (under tensor parallelism on rank 0; every
        rank calls it, the others get their own columns)."""
        return comm.gather_vocab(self.lm_head(hidden).float(), self.config.vocab_size)

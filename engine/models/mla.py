"""Multi-head latent attention (DeepSeek-V2/V3), served from a cache of latents.

Per token the layer compresses the hidden state into a latent c (kv_lora_rank,
normalised) and one rotary key k_rot shared by every head; each head's key is
[W_UK[h] c, k_rot] and its value W_UV[h] c (W_UK, W_UV: the rows of kv_b_proj).
The paged cache holds [c, k_rot] per token, one "head" of kv_lora_rank +
qk_rope_head_dim values, instead of every head's key and value: 576 values a token
and layer for DeepSeek-V3 against 128 x (192 + 128) = 40,960.

Attention runs on the latents directly, with the up-projections absorbed as the
DeepSeek-V2 paper and vLLM do: q_nope[h] . (W_UK[h] c) = (W_UK[h]^T q_nope[h]) . c,
so each head's query becomes [W_UK[h]^T q_nope[h], q_rot] and its keys are the cache
rows themselves; the output sum_j p_j W_UV[h] c_j = W_UV[h] (sum_j p_j c_j) is the
attention over the latents, then W_UV[h]. That is multi-query attention with one
KV head, which the CPU paths (the torch reference, kvserve's CPU kernels, the
compiled decode graphs) run as such: the cache tensor is passed as both K and V, and
of each head's output only the latent part is kept (the rotary part is attention
over k_rot, unused); Triton has latent kernels of its own that read each row once
(engine/kernels/attention/triton/latent_absorbed.py). Long prompt chunks are
expanded per head instead (fewer multiply-adds past ~170 queries at DeepSeek-V3's
widths, as vLLM's prefill does): engine/kernels/attention/latent.py."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.kernels.attention.latent import latent_attention
from kvserve.engine.kernels.attention.cpu_paged import PagedDecode, decode_in_place
from kvserve.engine.models.layers import PlainWeight, RMSNorm
from kvserve.engine.models.linear import Linear
from kvserve.engine.models.lora_step import LoRAStep
from kvserve.engine.models.rotary import apply_rotary, yarn_mscale
from kvserve.engine.models.tp_layers import RowParallelLinear
from kvserve.engine.models.tp_shard import SINGLE, TPShard

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a norms keep RMSNorm's default eps


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE over dims paired (0, 1), (2, 3), ... (DeepSeek's layout), returned as
    [rotated evens, rotated odds]: queries and keys alike, so their products hold."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LatentUpProjection(PlainWeight):
    """kv_b_proj: each head's key rows (qk_nope_head_dim of them), then its value
    rows (v_head_dim), over the latent, [H * (nope + v), L]. A GGUF holds it as
    llama.cpp splits it: shard 0, every head's key part transposed [H, L, nope]
    (attn_k_b); shard 1, the value parts [H, v, L] (attn_v_b)."""

    def __init__(self, num_heads: int, mla):
        super().__init__(num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.num_heads, self.nope = num_heads, mla.qk_nope_head_dim

    def load_shard(self, attr: str, shard: int, tensor: torch.Tensor) -> None:
        heads = self.weight.data.view(self.num_heads, -1, self.in_features)
        part = heads[:, :self.nope] if shard == 0 else heads[:, self.nope:]
        tensor = tensor.transpose(1, 2) if shard == 0 else tensor
        if tensor.shape != part.shape:
            raise ValueError(f"kv_b_proj part {shard} of shape {tuple(tensor.shape)}, "
                             f"expected {tuple(part.shape)}")
        part.copy_(tensor)


class MLAttention(nn.Module):
    """The heads one tensor-parallel rank holds; the latent cache is every rank's."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, shard: TPShard = SINGLE):
        super().__init__()
        mla, h = cfg.mla, cfg.hidden_size
        self.layer, self.mla = layer, mla
        self.num_heads = shard.heads(cfg)
        self.num_kv_heads = 1  # the cache's one latent "head"
        self.window, self.softcap, self.sinks, self.rope_index = 0, 0.0, None, 0
        q_out = self.num_heads * mla.qk_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = Linear(h, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(h, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, mla.cache_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        # Read as W_UK and W_UV, never applied as a linear layer.
        self.kv_b_proj = LatentUpProjection(self.num_heads, mla)
        self.o_proj = RowParallelLinear(self.num_heads * mla.v_head_dim, h, bias=False)
        rope = cfg.rope
        self.scale = mla.qk_head_dim ** -0.5
        if rope.rope_type == "yarn" and rope.mscale_all_dim:
            self.scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        # Set by the model runner once the cache is allocated (one tensor: K is V).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_scales = None
        self.key_rotation = None

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, L] and W_UV [H, v, L], views of kv_b_proj's weight."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, -1, mla.kv_lora_rank)
        return w[:, :mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim:]

    def _rotate(self, x, rope):
        if self.mla.rope_interleave:
            return apply_rotary_interleaved(x, *rope)
        return apply_rotary(x, *rope)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                paged: PagedDecode | None = None, lora: LoRAStep | None = None
                ) -> torch.Tensor:
        mla, n = self.mla, x.shape[0]

        def adapted(group: str, inputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return y if lora is None else lora.add(group, self.layer, inputs, y)

        if mla.q_lora_rank:
            q_a = self.q_a_layernorm(adapted("q_a", x, self.q_a_proj(x)))
            q = adapted("q_b", q_a, self.q_b_proj(q_a))
        else:
            q = adapted("qkv", x, self.q_proj(x))
        q_nope, q_rot = q.view(n, self.num_heads, -1).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rot = adapted("kv_a", x, self.kv_a_proj_with_mqa(x)).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        entry = torch.cat((self.kv_a_layernorm(latent),
                           self._rotate(k_rot.unsqueeze(1), rope).squeeze(1)), dim=-1)
        entry = entry.unsqueeze(1)  # [T, 1, L + R]: the token's cache row
        w_uk, w_uv = self._up_projections()
        q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk)
        q = torch.cat((q_latent, self._rotate(q_rot, rope)), dim=-1)  # [T, H, L + R]
        if paged is None:  # long prompt chunks expanded where the backend can
            o, expanded = latent_attention(q, q_nope, entry, self.k_cache,
                                           self.kv_b_proj.weight, self.scale,
                                           mla.qk_nope_head_dim)
        else:
            o = decode_in_place(q, entry, entry, self.k_cache, self.v_cache, paged,
                                self.scale)
            expanded = None
        o = torch.einsum("thl,hvl->thv", o[..., :mla.kv_lora_rank], w_uv)
        if expanded is not None:
            o = o + expanded
        o = o.reshape(n, -1)
        return adapted("o", o, self.o_proj(o))

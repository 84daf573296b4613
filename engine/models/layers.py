"""Building blocks of the Llama family, written for a flat batch of tokens [T, ...]."""
from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.engine.config.model_config import RopeConfig
from kvserve.engine.models.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then scale in x's dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1 context extension: long wavelengths are slowed by `factor`, short ones
    # kept, and the band between is interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.materialize(torch.device("cpu"))

    def materialize(self, device: torch.device) -> None:
        """(Re)build the float32 table on `device`; the loader calls this after the
        model's parameters were created without data."""
        inv_freq = rope_inv_freq(self.head_dim, self.rope).to(device)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()  # [P, D/2]; not parameters

    def table(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin for these positions, [T, 1, D/2] in `dtype`; gathered once per
        forward pass and shared by every layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, H, D]. The table is computed in float32 and the product
    taken in x's dtype, as the reference implementation does."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class PackedLinear(Linear):
    """A linear layer whose weight stacks several checkpoint tensors along the output
    dim (q/k/v, or gate/up), so one matmul replaces several."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.shard_sizes = shard_sizes

    def load_shard(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        target = self.weight if name == "weight" else self.bias
        start, size = self.shard_offsets[shard], self.shard_sizes[shard]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard} has {tensor.shape[0]} rows, expected {size}")
        target.data[start:start + size].copy_(tensor)

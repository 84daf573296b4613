"""Building blocks of the decoders, written for a flat batch of tokens [T, ...]
(rotary embeddings: rotary.py)."""
from __future__ import annotations

import torch
from torch import nn

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


class PlainWeight(nn.Module):
    """A weight [out_features, in_features] the model reads itself rather than
    multiplies by as a linear layer (MLA's up-projections, DeepSeek's float32
    router): not a Linear, so CPU packing and weight quantization leave it as it is
    (out_features / in_features: what tensor parallelism slices, as for a Linear)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

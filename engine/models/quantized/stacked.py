"""One projection made of shards kept in different forms (a Q4_K_M file's query and
key in Q4_K, its value in Q6_K: int4 layers for the first two, a byte a weight for
the third), outputs joined as the packed layer's would be. Stacking them into one
int8 layer instead would double the 4-bit shards' bytes."""
from __future__ import annotations

import torch
from torch import nn


class StackedLinear(nn.Module):
    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

"""The model's linear layer: torch's F.linear, or on CPU kvserve's packed GEMM
(engine/kernels/cpu) once `pack` has replaced its float32 or bf16 weight with packed
panels."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.kernels.cpu.packing import PackedWeight, pack_weight


class Linear(nn.Linear):
    """nn.Linear whose product goes through kvserve::packed_linear once packed."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.packed: PackedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x times the weight, plus `bias` unless None."""
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        return self.packed.product(x, self.out_features, bias)

    def pack(self, round_to_int8: bool = False, bf16_pairs: bool = False) -> None:
        """The weight packed (int4, int8 or bf16 panels where they hold its values
        exactly), and the float weight let go: this layer holds one copy. A tied
        weight (the LM head's, the embedding's) stays with the embedding.
        round_to_int8: a weight on no such grid is rounded to GGUF's Q8_0 (int8, a
        float16 scale per 32 inputs) instead of kept in float panels (pack_weight), and
        multiplies inputs quantized to int8 where the kernel can, as llama.cpp's Q8_0
        head does (a quantized model's head: int8_inputs). bf16_pairs: a bf16 model's
        layer on an AVX512-BF16 CPU, packed for kvserve::bf16_linear (pack_weight)."""
        self.packed = PackedWeight(pack_weight(self.weight.detach(), round_to_int8, bf16_pairs),
                                   int8_inputs=round_to_int8)
        self.weight = None

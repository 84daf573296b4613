"""What every quantized linear layer shares: rows in, the subclass's product of the
quantized weights (or kvserve's CPU GEMM over them, once packed), then the bias; and
the guard every per-row or per-group scale needs."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.kernels.cpu.packing import Packed, PackedWeight


class QuantizedLinear(nn.Module):
    """[..., in_features] -> [..., out_features] through `matmul` of the rows as one
    2-D tensor. input_scales: activation-aware scaling (awq.py), the weights hold
    W * s and the inputs are divided by s."""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None,
                 input_scales: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("input_scales", input_scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed: PackedWeight | None = None

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """[M, K] rows times the layer's weights: [M, N], in x2's dtype."""
        raise NotImplementedError

    def fits_panels(self) -> bool:
        """Whether kvserve's CPU GEMM has panels for this kind (cheap: nothing is
        packed to find out)."""
        return False

    def quantized_panels(self) -> Packed | None:
        """The weights in kvserve's CPU GEMM layout (engine/kernels/cpu/packing.py),
        or None where it has none for this kind (fits_panels)."""
        return None

    def pack(self) -> bool:
        """Products through kvserve's CPU GEMM from now on, reading the quantized
        bytes as they are (its panels replace the layer's own copy); False where
        this kind has no panels."""
        packed = self.quantized_panels()
        if packed is None:
            return False
        self.packed = PackedWeight(packed, int8_inputs=True)
        self.drop_unpacked()
        return True

    def drop_unpacked(self) -> None:
        """Let go of the weights the panels replace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.input_scales is not None:
            x2 = x2 / self.input_scales
        if self.packed is not None:
            y = self.packed.product(x2, self.out_features, self.bias)
        else:
            y = self.matmul(x2)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def nonzero(scales: torch.Tensor) -> torch.Tensor:
    """Scales with every 0 (an all-zero row or a constant group) replaced by 1, so
    nothing divides by zero; the values they scale are 0 either way."""
    return torch.where(scales > 0, scales, torch.ones_like(scales))

"""Weight-only int8 linear layers (--quantization int8): each output channel's
weights rounded to the nearest of 255 levels of one scale (absmax / 127), stored as
int8 (a quarter of float32's bytes, half of bf16's) and multiplied in the model
dtype. On CPUs with kvserve's kernels (float32, AVX2) its GEMM reads the int8 panels
directly for any number of rows; otherwise torch's `_weight_int8pack_mm` does for
decode-sized batches in bf16, and elsewhere the weights are converted per call
(correct, not yet fast; a fused GPU kernel is still to be measured in
bench/gpu_session.sh).
Also GGUF's Q8_0 (one scale per group of 32), kept as it is."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.kernels.cpu import packing
from kvserve.engine.kernels.group_quant import group_weights
from kvserve.engine.models.quantized.group_scales import group_values
from kvserve.engine.models.quantized.kernel_rows import few_rows
from kvserve.engine.models.quantized.layer import QuantizedLinear, nonzero

# torch's CPU int8 kernel reads int8 weights directly, but only pays for a few rows
# in bf16/fp16 (bench/results/cpu_int8_kernels_2026-11-24.md: 1.9x faster than the
# bf16 matmul for one row, even at 8, 2.7x slower at 32; in fp32 always slower).
# Past it, and in fp32, the weights are converted to the model dtype per call.
INT8PACK_MAX_ROWS = 8


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> ([N, K] int8, [N] scales in `dtype`), symmetric per output
    channel, round to nearest: weight ~= q * scale[:, None]. The scales are rounded
    to `dtype` first and the weights divided by the rounded ones, so the kernel's
    scales are the ones the rounding used."""
    w = weight.float()
    scales = nonzero((w.abs().amax(dim=1) / 127).to(dtype))
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def fake_quantize_int8(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weights `Int8Linear` would compute with."""
    q, scales = quantize_int8(weight, torch.float32)
    return q.float() * scales[:, None]


class Int8Weights(QuantizedLinear):
    """What both int8 layers share: `qweight` and `scales` (per output channel, or
    per group of inputs), packed as they are for kvserve's CPU GEMM."""

    def fits_panels(self) -> bool:
        return True

    def quantized_panels(self) -> packing.Packed | None:
        return packing.pack_int8(self.qweight, self.scales) if self.fits_panels() else None

    def drop_unpacked(self) -> None:
        self.qweight = self.scales = None


class Int8Linear(Int8Weights):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 input_scales: torch.Tensor | None = None):
        super().__init__(*qweight.shape, bias, input_scales)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def of(cls, linear: nn.Linear, input_scales: torch.Tensor | None = None) -> Int8Linear:
        w = linear.weight.data
        if input_scales is not None:
            w = w.float() * input_scales.float()
        q, scales = quantize_int8(w, linear.weight.dtype)
        return cls(q, scales, linear.bias.data if linear.bias is not None else None,
                   input_scales)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.device.type == "cpu" and x2.dtype != torch.float32 \
                and few_rows(x2, INT8PACK_MAX_ROWS):
            return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        return torch.nn.functional.linear(x2, self.qweight.to(x2.dtype)) * self.scales


class GroupInt8Linear(Int8Weights):
    """GGUF's group-quantized types kept as they are: int8 weights with one scale per
    group of inputs along K (w = q * scale), and a minimum per group where the type
    has one (w = q * scale + min: Q5_1, Q5_K, Q2_K). Q8_0 as it is; Q5_0/Q5_1, Q5_K
    and Q6_K in a byte a weight. Scales [K / group, N] float16 (or float32); the
    K-quants' are two factors, scale_base / min_base [K / 256, N] the second
    (group_scales.py). torch has no kernel for group-wise int8, so the weights are
    expanded per call: the bytes stay a quarter of fp32's in memory, the speed is the
    float matmul's plus the expansion."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, mins: torch.Tensor | None = None, *,
                 scale_base: torch.Tensor | None = None,
                 min_base: torch.Tensor | None = None):
        super().__init__(*q.shape, None if bias is None else bias.to(dtype))
        self.group_size = self.in_features // scales.shape[0]
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("scale_base", scale_base)
        self.register_buffer("min_base", min_base)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weights in `dtype`, computed in float32 (exactly GGUF's own
        de-quantization)."""
        mins = group_values(self.mins, self.min_base, 0)
        return group_weights(self.qweight, group_values(self.scales, self.scale_base, 0).t(),
                             None if mins is None else mins.t(), dtype)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x2, self.dequantized(x2.dtype))

    def fits_panels(self) -> bool:
        # the int8 panels hold one float16 scale a group, no minimums
        return self.mins is None and self.scale_base is None \
            and self.scales.dtype == torch.float16

    def drop_unpacked(self) -> None:
        self.qweight = self.scales = self.mins = self.scale_base = self.min_base = None

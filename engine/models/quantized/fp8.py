"""fp8 weights (--quantization fp8, vLLM's online fp8): each decoder projection's
weights as float8 e4m3 with one float32 scale per output channel (absmax / 448),
and each step's activations quantized per token (row) on the fly, both multiplied
by torch._scaled_mm (cuBLASLt's fp8 GEMM with row-wise scales), output in bf16.
Half of bf16's bytes, and Hopper's fp8 tensor cores for prompts.

Only on GPUs with fp8 tensor cores (compute capability 8.9: Ada, Hopper, newer):
elsewhere start-up stops with the alternatives (check_fp8_device). torch's CPU
build has a _scaled_mm too, which the unit tests use to check the layer's
arithmetic; it is not a fast path, so the CPU is refused for serving."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.kernels.fp8_cache import FP8_MAX, to_fp8
from kvserve.engine.models.quantized.layer import QuantizedLinear, nonzero
from kvserve.modelstore.errors import ModelLoadError

# cuBLASLt's fp8 GEMM needs both matrix dimensions in multiples of 16.
FP8_DIM_MULTIPLE = 16


def check_fp8_device(device: torch.device) -> None:
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= (8, 9):
            return
        where = "a GPU of compute capability %d.%d" % capability
    else:
        where = device.type
    raise ModelLoadError(
        f"--quantization fp8 needs fp8 tensor cores (an NVIDIA GPU of compute capability "
        f"8.9 or newer: Ada, Hopper), not {where}; use --quantization int8 or int4")


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> ([N, K] e4m3, [N] float32 scales): weight ~= q * scale[:, None]."""
    w = weight.float()
    scales = nonzero(w.abs().amax(dim=1) / FP8_MAX)
    return to_fp8(w, scales[:, None]), scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> ([M, K] e4m3, [M, 1] float32 scales), one per row, on the
    device (no host sync: CUDA graphs can hold it)."""
    x = x.float()
    scales = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return to_fp8(x, scales), scales


class Fp8Linear(QuantizedLinear):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(*qweight.shape, bias)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.reshape(1, -1))  # _scaled_mm's scale_b

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp8Linear:
        q, scales = quantize_fp8(linear.weight.data)
        return cls(q, scales, linear.bias.data if linear.bias is not None else None)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        xq, x_scales = quantize_rows(x2)
        # Row-wise scales take a bf16 output; qweight.t() is the column-major operand
        # _scaled_mm wants.
        return torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scales, scale_b=self.scales,
                                out_dtype=torch.bfloat16).to(x2.dtype)


def check_fp8_shapes(linears) -> None:
    for name, linear in linears:
        rows, cols = linear.weight.shape
        if rows % FP8_DIM_MULTIPLE or cols % FP8_DIM_MULTIPLE:
            raise ModelLoadError(f"fp8 GEMMs need dimensions in multiples of "
                                 f"{FP8_DIM_MULTIPLE}; {name} is {rows}x{cols}: use "
                                 "--quantization int8")

"""Weight-only int8 linear layers (--quantization int8): each output channel's
weights rounded to the nearest of 255 levels of one scale (absmax / 127), stored as
int8 (a quarter of float32's bytes, half of bf16's) and multiplied in the model
dtype. On CPU torch's `_weight_int8pack_mm` reads the int8 weights directly for
decode-sized batches in bf16; elsewhere the weights are converted per call (correct,
not yet fast; a fused GPU kernel is still to be measured in bench/gpu_session.sh).

Applied at load (online quantization, as vLLM's --quantization fp8): the decoder
layers' projections are quantized, the embeddings and the LM head stay in the model
dtype (the LM head's error would reach every logit)."""
from __future__ import annotations

import torch
from torch import nn

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
    scales = (w.abs().amax(dim=1) / 127).to(dtype)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear) -> Int8Linear:
        q, scales = quantize_int8(linear.weight.data, linear.weight.dtype)
        return cls(q, scales, linear.bias.data if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x.device.type == "cpu" and x.dtype != torch.float32 \
                and x2.shape[0] <= INT8PACK_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            y = torch.nn.functional.linear(x2, self.qweight.to(x.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_model(model: nn.Module, mode: str) -> None:
    """In place: every linear layer of the decoder layers becomes `mode`'s."""
    if mode == "none":
        return
    for layer in model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear.of(child))


def model_bytes(model: nn.Module) -> int:
    """What the model's weights hold in memory (a tied weight counted once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())

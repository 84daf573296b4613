"""Group-quantized weights expanded to floats: int8 values (or 4-bit codes two to a
byte) times a float32 scale, plus a minimum, per group of inputs, in float32 as GGUF
de-quantizes them. Shared by GGUF's dense group-int8 layers
(models/quantized/int8.py) and its kept experts (moe/fused_experts.py)."""
from __future__ import annotations

import torch


def code_values(q: torch.Tensor) -> torch.Tensor:
    """Codes as float32 [.., K]: int8 values as they are, or uint8 bytes each holding
    two 4-bit codes (input 2j in the low nibble, 2j + 1 in the high), [.., K / 2]."""
    if q.dtype == torch.uint8:
        q = torch.stack((q & 15, q >> 4), dim=-1).flatten(-2)
    return q.float()


def group_weights(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] int8 (or [N, K / 2] nibble pairs, code_values) with a float32 scale
    (and minimum) [N, G] per group of K / G inputs -> w [N, K] in `dtype`, computed
    in float32."""
    w = code_values(q).unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]
    if low is not None:
        w = w + low[..., None]
    return w.flatten(-2).to(dtype)

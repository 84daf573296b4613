"""Values of an fp8 KV cache as torch ops, shared by the torch reference and the
compiled CPU decode: e4m3 bytes, each a K or V value divided by its layer's scale
(engine/weights/quantization/kv_fp8.py says where the scales come from)."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3, saturated at +-FP8_MAX (torch's cast does not promise to
    saturate on every device)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def store_rows(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
               scale: torch.Tensor | None) -> None:
    """Rows x [T, Hkv, D] into cache slots; divided by `scale` and rounded to e4m3
    first when there is one."""
    if scale is not None:
        # index_copy_ has no fp8 kernel on CPU: the bytes are copied as uint8.
        x, cache = to_fp8(x, scale).view(torch.uint8), cache.view(torch.uint8)
    cache.view(-1, *cache.shape[-2:]).index_copy_(0, slots, x)


def read_rows(rows: torch.Tensor, scale: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a cache, in `dtype`: multiplied back by `scale` if fp8."""
    if scale is None:
        return rows
    return (rows.float() * scale).to(dtype)


def key_rotation(head_dim: int) -> torch.Tensor:
    """An orthogonal [D, D] float32 matrix that turns queries and keys before an
    fp8 cache (engine/weights/quantization/kv_fp8.py says why): Hadamard / sqrt(D) for a
    power of two, else the Q of a seeded Gaussian's QR (the same in every run)."""
    if _power_of_two(head_dim):
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:  # Sylvester's construction
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        return h / head_dim ** 0.5
    gauss = torch.randn(head_dim, head_dim, generator=torch.Generator().manual_seed(0))
    return torch.linalg.qr(gauss).Q


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ rotation (key_rotation's). On CPU a Hadamard rotation is done as
    log2(D) butterfly stages of adds and subtracts in float32, which Inductor fuses
    with RoPE's loop: a matmul per query and key tensor per layer costs more than the
    whole decode attention at batch 1. Elsewhere one matmul."""
    d = x.shape[-1]
    if x.device.type != "cpu" or not _power_of_two(d):
        return x @ rotation
    lead, y, half = x.shape[:-1], x.float(), 1
    while half < d:  # each stage applies [[1, 1], [1, -1]] along one bit of the index
        pairs = y.reshape(*lead, d // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        half *= 2
    return (y * d ** -0.5).to(x.dtype)


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0

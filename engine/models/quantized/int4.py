"""Weight-only int4 linear layers: groups of `group_size` weights along the input
dimension share one scale and one minimum (w = q * scale + min, q in 0..15), the
layout of GGUF's Q4_1 (Q4_0 is the case min = -8 * scale). Scales and minimums are
kept in float16, as GGUF stores them, so a repacked GGUF block is exact.

The nibbles are stored in the layout of torch's CPU int4 kernel
(`_convert_weight_to_int4pack_for_cpu`), which reads them directly for a few rows in
bf16 (decode: 2.4-2.6x faster than the bf16 matmul at one row). For more rows, and in
float32 where that kernel is 10-100x slower than a float matmul, the weights are
expanded per call (bench/results/cpu_int4_kernels_2026-11-24.md). Where kvserve's CPU
kernels run (float32 on AVX2 CPUs without AVX-512) the layer is repacked into their
int4 panels instead, read directly for any number of rows (`pack`). The same bytes
serve a CUDA device (expanded per call there too; a fused kernel waits for a GPU
session, bench/gpu_session.sh)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from kvserve.engine.kernels.cpu import packing
from kvserve.engine.models.quantized.group_scales import group_values
from kvserve.engine.models.quantized.kernel_rows import few_rows
from kvserve.engine.models.quantized.layer import QuantizedLinear, nonzero

# Rows are packed in blocks whose size and order depend on the CPU capability torch
# dispatches to (kernel_layout): 64 with AVX-512, 32 with AVX2. Layers keep their
# rows in whole blocks of the largest.
PACK_ROWS = 64
# The layouts torch's CPU packing is known to use, as (rows per block, halves):
# byte (k, j) of block b holds row B*b + j in its low nibble and, with `halves`, row
# B*b + B/2 + j in its high one (AVX-512: B = 64; AVX2: B = 32), or else row
# B*b + 2j and B*b + 2j + 1 (adjacent pairs, the unvectorised build).
KNOWN_LAYOUTS = ((64, True), (32, True), (32, False), (64, False), (16, True), (16, False))
# Rows up to which the CPU kernel beats expanding the weights (bf16, SmolLM2's
# shapes: 2.5x at 1 row, 1.3-1.8x at 16, even at 32).
INT4PACK_MAX_ROWS = 32
# The group sizes torch's CPU int4 kernel takes (GGUF's Q2_K/Q3_K groups of 16 are
# expanded instead).
INT4PACK_GROUPS = (32, 64, 128, 256)


def quantize_int4(weight: torch.Tensor, group_size: int, symmetric: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] uint8 in 0..15, scales [K/g, N] fp16, mins [K/g, N]
    fp16): round to nearest over each group's range, min and max included. Scales
    and minimums are rounded to fp16 first and q computed from the rounded ones.
    symmetric: GGUF Q4_0's grid, w = (q - 8) * scale (min = -8 * scale, which the CPU
    kernel derives rather than reads: 4.5 bits a weight, not 5), scale the group's
    value of largest magnitude over -8, so that value is exact (q = 0) and the
    other side reaches 7 steps."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    if symmetric:
        extreme = w.gather(2, w.abs().argmax(dim=2, keepdim=True))[..., 0]
        scales = (extreme / -8).half()  # negative where the extreme is positive
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        mins = -8 * scales
    else:
        lo, hi = w.amin(dim=2), w.amax(dim=2)
        scales = nonzero(((hi - lo) / 15).half())
        mins = lo.half()
    q = torch.round((w - mins.float()[..., None]) / scales.float()[..., None])
    q = q.clamp(0, 15).to(torch.uint8).reshape(n, k)
    return q, scales.t().contiguous(), mins.t().contiguous()


def fake_quantize_int4(weight: torch.Tensor, group_size: int,
                       symmetric: bool = False) -> torch.Tensor:
    """The float32 weights `Int4Linear` would compute with."""
    q, scales, mins = quantize_int4(weight, group_size, symmetric)
    n, k = q.shape
    w = q.view(n, -1, group_size).float() * scales.t().float()[..., None] \
        + mins.t().float()[..., None]
    return w.view(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] uint8 in the CPU kernel's layout."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.cpu().to(torch.int32), 1)


def unpack_int4_t(packed: torch.Tensor, layout: tuple[int, bool] | None = None
                  ) -> torch.Tensor:
    """The kernel layout back to q transposed, [K, N]: the rows of a block lie
    contiguous in it, so the expansion reads and writes in long runs. Compiled code
    passes the layout (a layer's constant): the probe is not for tracing."""
    return _unpack_t(packed, *(layout or kernel_layout()))


def _unpack_t(packed: torch.Tensor, block: int, halves: bool) -> torch.Tensor:
    n, k = packed.shape[0], packed.shape[1] * 2
    p = packed.view(n // block, k, block // 2).permute(1, 0, 2)  # [K, N/block, block/2]
    return torch.stack([p & 15, p >> 4], dim=2 if halves else 3).reshape(k, n)


@functools.cache
def kernel_layout() -> tuple[int, bool]:
    """The layout this process's torch packs in, read off the packing op itself: it
    follows the CPU capability torch dispatches to (the machine's, or
    ATEN_CPU_CAPABILITY), which a model checked on one machine may not share with
    the next."""
    probe = torch.randint(0, 16, (PACK_ROWS, 8), generator=torch.Generator().manual_seed(0),
                          dtype=torch.uint8)
    packed = pack_int4(probe)
    for block, halves in KNOWN_LAYOUTS:
        if torch.equal(_unpack_t(packed, block, halves), probe.T):
            return block, halves
    raise RuntimeError(
        "this torch build packs int4 weights for its CPU kernel in a layout kvserve does "
        f"not know (CPU capability {torch.backends.cpu.get_cpu_capability()}); "
        "use --quantization int8, or a float checkpoint")


class Int4Linear(QuantizedLinear):
    """scales and mins: [K / group, N], float16 (ours, GGUF's Q4_0/Q4_1, the
    K-quants' sub-block factors) or float32. GGUF's K-quants add scale_base /
    min_base [K / 256, N] float16, each group's value the product of the two
    (group_scales.py); its IQ4 types a codebook, the 16 int8 values q indexes
    (w = codebook[q] * scale, no minimums)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None, dtype: torch.dtype,
                 input_scales: torch.Tensor | None = None, *,
                 scale_base: torch.Tensor | None = None, min_base: torch.Tensor | None = None,
                 codebook: torch.Tensor | None = None):
        super().__init__(*q.shape, None if bias is None else bias.to(dtype), input_scales)
        if self.out_features % PACK_ROWS or self.in_features % scales.shape[0]:
            raise ValueError(f"int4 needs out_features divisible by {PACK_ROWS} and whole "
                             f"groups, got {tuple(q.shape)}")
        self.group_size = self.in_features // scales.shape[0]
        device = scales.device
        self.register_buffer("int4pack", pack_int4(q).to(device))
        self.layout = kernel_layout()  # how pack_int4 laid it out in this process
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("scale_base", scale_base)
        self.register_buffer("min_base", min_base)
        self.register_buffer("codebook", codebook)
        # The CPU kernel's own (scale, zero) pairs, w = (q - 8) * scale + zero, in the
        # activations' dtype: only where it is used (bf16 on CPU, a grid of 16 levels).
        kernel = None
        if device.type == "cpu" and dtype == torch.bfloat16 and codebook is None \
                and mins is not None and self.group_size in INT4PACK_GROUPS:
            scale, low = self.scale_and_min()
            kernel = torch.stack([scale, low + 8 * scale], dim=-1).to(dtype)
        self.register_buffer("kernel_scales_zeros", kernel)

    def scale_and_min(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each group's scale and minimum in float32, [K / group, N]."""
        return (group_values(self.scales, self.scale_base, 0),
                group_values(self.mins, self.min_base, 0))

    @classmethod
    def of(cls, linear: nn.Linear, group_size: int,
           input_scales: torch.Tensor | None = None, symmetric: bool = False) -> Int4Linear:
        w = linear.weight.data
        if input_scales is not None:
            w = w.float() * input_scales.float()
        q, scales, mins = quantize_int4(w, group_size, symmetric)
        device = linear.weight.device
        return cls(q, scales.to(device), mins.to(device),
                   linear.bias.data if linear.bias is not None else None, linear.weight.dtype,
                   input_scales)

    def dequantized_t(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights as [K, N] in `dtype`, computed in float32 (exactly GGUF's
        own de-quantization for a repacked block)."""
        q = unpack_int4_t(self.int4pack, self.layout).view(-1, self.group_size,
                                                          self.out_features)
        values = self.codebook.float()[q.long()] if self.codebook is not None else q.float()
        scale, low = self.scale_and_min()
        w = values * scale[:, None, :]
        if low is not None:
            w = w + low[:, None, :]
        return w.view(self.in_features, self.out_features).to(dtype)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.kernel_scales_zeros is not None and few_rows(x2, INT4PACK_MAX_ROWS):
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.int4pack, self.group_size, self.kernel_scales_zeros)
        return x2 @ self.dequantized_t(x2.dtype)

    def fits_panels(self) -> bool:
        # the panels hold one float16 scale and minimum a group
        return self.scale_base is None and self.codebook is None and self.mins is not None \
            and self.scales.dtype == torch.float16 and self.mins.dtype == torch.float16

    def quantized_panels(self) -> packing.Packed | None:
        if not self.fits_panels():
            return None
        q = unpack_int4_t(self.int4pack, self.layout).t()
        return packing.pack_int4(q, self.scales, self.mins)

    def drop_unpacked(self) -> None:
        self.int4pack = self.kernel_scales_zeros = self.scales = self.mins = None
        self.scale_base = self.min_base = self.codebook = None

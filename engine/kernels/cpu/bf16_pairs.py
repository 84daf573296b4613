"""A bf16 model's float weights in the layout kvserve::bf16_linear reads
(bf16_pairs.cpp): panels of 16 output columns holding pairs of inputs side by side,
[ceil(N / 16), K / 2, 32], element (p, k, 2j + i) = W[16p + j, 2k + i], the last panel
zero-padded. One 64-byte row of a panel is one operand of AVX512-BF16's dot product.

Used on CPUs with AVX512-BF16 for a bf16 model's float layers (engine/weights/
cpu_packing.py): the packed tensor is the layer's only copy of its weight, read by the
eager path and by every compiled graph alike, where oneDNN's prepacked layout had to
be frozen into each graph as a copy of its own."""
from __future__ import annotations

import torch

from kvserve.engine.platform.device import cpu_flags

PANEL = 16
PAIRS_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512_bf16")


def bf16_pairs_here(flags: set[str] | None = None) -> bool:
    """Whether this CPU (or one with `flags`) runs bf16_linear."""
    flags = cpu_flags() if flags is None else flags
    return all(f in flags for f in PAIRS_FLAGS)


def amx_here() -> bool:
    """Whether bf16_linear multiplies on AMX tiles here (a CPU with AMX-BF16, whose
    tiles Linux granted this process; bf16_pairs_amx.h). The kernels must be loaded."""
    return torch.ops.kvserve.bf16_amx_here()


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor | None:
    """[N, K] weight (bf16, or float32 values exact in bf16) -> its pair panels in
    bf16, or None where K is odd (no pairs) or a value would round. Each pair of
    inputs is moved as one 32-bit word (a 3-D transpose, not 4-D: ~3x faster)."""
    n, k = weight.shape
    if k % 2:
        return None
    if weight.dtype != torch.bfloat16:
        rounded = weight.to(torch.bfloat16)
        if not torch.equal(rounded.to(weight.dtype), weight):
            return None
        weight = rounded
    panels = -(-n // PANEL)
    if n % PANEL:
        weight = torch.cat([weight, weight.new_zeros(panels * PANEL - n, k)])
    words = weight.contiguous().view(torch.int32).view(panels, PANEL, k // 2)
    return words.transpose(1, 2).contiguous().view(torch.bfloat16).view(
        panels, k // 2, 2 * PANEL)


def is_pairs(panels: torch.Tensor) -> bool:
    """Whether packed panels are pair panels (the other bf16 kind is [P, K, 16])."""
    return panels.dtype == torch.bfloat16 and panels.dim() == 3 and panels.shape[2] == 2 * PANEL


def pairs_values(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] float32 weight pair panels hold."""
    p, pairs, _ = panels.shape
    return panels.view(p, pairs, PANEL, 2).permute(0, 2, 1, 3).reshape(
        p * PANEL, 2 * pairs)[:n].float()


def pairs_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight, [len(ids), K] float32 (a tied embedding's lookup)."""
    p, pairs, _ = panels.shape
    rows = panels.view(p, pairs, PANEL, 2)[ids // PANEL, :, ids % PANEL]
    return rows.reshape(*ids.shape, 2 * pairs).float()


def bf16_linear(x: torch.Tensor, panels: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] bf16 times the weight, plus bias: [..., n] bf16."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    y = torch.ops.kvserve.bf16_linear(rows, panels, n, bias)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)

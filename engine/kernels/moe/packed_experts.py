"""The routed experts on kvserve's CPU GEMM (engine/kernels/cpu): `kvserve::packed_experts`.

Each expert's w13 and w2 packed as packed_linear's panels and stacked ([E, P, K, 16]:
bf16 where every value is exact in bf16, else float32; int8 with a scale per output
column for --quantization int8). The pairs are sorted by expert as fused_experts
sorts them, and each of the two grouped GEMMs is one call of
kvserve::packed_grouped_linear (packed_experts.cpp), which splits every active
expert's panels across the threads. Activations go through it in float32.

Against torch's grouped GEMM on the same bf16 experts (16 tokens, 59 of 64 experts of
1024 x 384 active, 2-core Zen 4): it reads the weights at ~20 GB/s, torch at ~12.
It is an op of its own, as fused_experts is, so torch.compile leaves it opaque."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvserve.engine.kernels.cpu.packing import BF16_ORDER, PANEL, bf16_panels, column_panels
from kvserve.engine.kernels.moe.fused_experts import gated, held_experts, sorted_pairs


class PackedExperts(NamedTuple):
    """One stacked expert weight packed: panels [E, P, K, 16] and, for int8 panels,
    scales [E, P * 16] float32 per output column (padded columns 1)."""
    panels: torch.Tensor
    scales: torch.Tensor | None = None


def pack_experts(weight: torch.Tensor, row_scales: torch.Tensor | None = None
                 ) -> PackedExperts:
    """weight [E, N, K]: float (packed bf16 where exact in bf16, else float32), or
    int8 with row_scales [E, N] (w = q * scale per output row)."""
    experts, n, k = weight.shape
    if row_scales is not None:
        if weight.dtype != torch.int8 or row_scales.shape != (experts, n):
            raise ValueError(f"int8 experts [E, N, K] with scales [E, N], not "
                             f"{tuple(weight.shape)} {weight.dtype} / {tuple(row_scales.shape)}")
        panels = torch.stack([column_panels(w) for w in weight])
        scales = torch.ones(experts, panels.shape[1] * PANEL)
        scales[:, :n] = row_scales.float()
        return PackedExperts(panels, scales)
    if not weight.is_floating_point():
        raise ValueError(f"float experts, or int8 ones with scales; not {weight.dtype}")
    values = weight.float()
    if torch.equal(values.to(torch.bfloat16).float(), values):
        return PackedExperts(torch.stack([bf16_panels(w) for w in values]))
    return PackedExperts(torch.stack([column_panels(w) for w in values]))


def unpack_experts(packed: PackedExperts, n: int) -> torch.Tensor:
    """The float32 [E, n, K] weights packed experts hold (tests check with it)."""
    panels = packed.panels
    if panels.dtype == torch.bfloat16:
        panels = panels[..., torch.argsort(BF16_ORDER)]
    values = panels.float()
    if packed.scales is not None:
        values = values * packed.scales.view(len(values), -1, 1, PANEL)
    experts, count, k, _ = values.shape
    return values.transpose(2, 3).reshape(experts, count * PANEL, k)[:, :n]


@torch.library.custom_op("kvserve::packed_experts", mutates_args=())
def packed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, intermediate: int, first_expert: int,
                   b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
                   activation: str = "silu", limit: float = 0.0, alpha: float = 0.0,
                   w13_scale: Optional[torch.Tensor] = None,
                   w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fused_experts.fused_experts's result from packed experts: x [T, H] (any float
    dtype); w13 [E, P, H, 16] panels of 2 * intermediate outputs, w2 [E, P', I, 16]
    of H; w*_scale [E, P * 16] float32 for int8 panels; b13 [E, 2I], b2 [E, H]
    float32. The weighted sum per token is taken in float32, then cast to x's dtype."""
    hidden = x.shape[1]
    counts, pairs, tokens = sorted_pairs(topk_ids, first_expert, w13.shape[0])
    grouped = torch.ops.kvserve.packed_grouped_linear
    h = grouped(x[tokens].float(), counts, w13, 2 * intermediate, b13, w13_scale)
    a = gated(h, activation, limit, alpha).contiguous()
    y = grouped(a, counts, w2, hidden, b2, w2_scale)
    y = y * topk_weights.reshape(-1)[pairs, None].float()
    return y.new_zeros(x.shape).index_add_(0, tokens, y).to(x.dtype)


@packed_experts.register_fake
def _packed_experts_shape(x, topk_ids, topk_weights, w13, w2, intermediate, first_expert,
                          b13=None, b2=None, activation="silu", limit=0.0, alpha=0.0,
                          w13_scale=None, w2_scale=None):
    return torch.empty_like(x)


def one_token_packed_experts(x: torch.Tensor, topk_ids: torch.Tensor,
                             topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                             intermediate: int, first_expert: int,
                             b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                             activation: str = "silu", limit: float = 0.0, alpha: float = 0.0,
                             w13_scale: torch.Tensor | None = None,
                             w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """packed_experts for one token (x [1, H]) as plain ops, for a compiled batch-1
    decode graph, as fused_experts.one_token_experts is for unpacked experts: each
    chosen expert's panels indexed where they lie and reduced against the token
    (Inductor fuses the indexing into its loops; the op's sort and calls cost more
    than the work at one token: 30 against 39 tok/s for a 2B Qwen3-MoE, bf16, 2-core
    Zen 4)."""
    local, held = held_experts(topk_ids, first_expert, w13.shape[0])

    def picked(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[local].float()

    h = _panels_dot(x[0].float(), w13[local], picked(w13_scale), 2 * intermediate)
    if b13 is not None:
        h = h + b13[local]
    a = gated(h, activation, limit, alpha)  # [K, I]
    y = _panels_dot(a, w2[local], picked(w2_scale), x.shape[1])  # [K, H]
    if b2 is not None:
        y = y + b2[local]
    weights = topk_weights[0].float() * held
    return (y * weights[:, None]).sum(0, keepdim=True).to(x.dtype)


def _panels_dot(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor | None,
                n: int) -> torch.Tensor:
    """x [K] or [k, K] (float32) against each of k experts' panels [k, P, K, 16]:
    [k, n] in float32 (columns put back in order, scaled per column for int8)."""
    y = (x.reshape(-1, 1, x.shape[-1], 1) * panels.float()).sum(-2)  # [k, P, 16]
    if panels.dtype == torch.bfloat16:
        y = y[..., _BF16_COLUMNS]
    y = y.flatten(-2)
    return (y if scale is None else y * scale)[:, :n]


# Where each column of a bf16 panel row lies (the inverse of BF16_ORDER).
_BF16_COLUMNS = torch.argsort(BF16_ORDER)

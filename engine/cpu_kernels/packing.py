"""Weights in the layout kvserve::packed_linear reads (packed_gemm.cpp), and the op
as the model and torch.compile call it.

A weight [N, K] becomes panels of 16 output columns, [ceil(N / 16), K, 16] (the last
panel padded with zeros). Where every value of the weight is exact in bfloat16 the
panels are bfloat16, their 16 columns ordered 0, 8, 1, 9, ... 7, 15 so that 32-bit
word j of a row holds column j in its low half and column j + 8 in its high half;
otherwise they are float32 in column order."""
from __future__ import annotations

import torch

PANEL = 16
# Column order within a bf16 panel row (see above); its inverse restores 0..15.
BF16_ORDER = torch.tensor([j + half for j in range(PANEL // 2) for half in (0, PANEL // 2)])


def exact_in_bf16(weight: torch.Tensor) -> bool:
    return bool(torch.equal(weight.to(torch.bfloat16).float(), weight))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> packed panels, bfloat16 where every value is exact in bf16."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"packs 2-D float32 weights, not {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    packed = padded.view(panels, PANEL, k).transpose(1, 2)  # [P, K, 16]
    if exact_in_bf16(weight):
        return packed[:, :, BF16_ORDER].to(torch.bfloat16).contiguous()
    return packed.contiguous()


def unpack_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 [n, K] weight a packed one holds (tests check packing with it)."""
    panels = packed.float()
    if packed.dtype == torch.bfloat16:
        panels = panels[:, :, torch.argsort(BF16_ORDER)]
    return panels.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight a packed one holds, [len(ids), K] float32: a tied
    embedding table looked up in its LM head's panels, with no table of its own."""
    lane = ids % PANEL
    if packed.dtype == torch.bfloat16:  # where BF16_ORDER put column `lane`
        lane = lane % (PANEL // 2) * 2 + lane // (PANEL // 2)
    return packed.permute(0, 2, 1)[ids // PANEL, lane].float()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 times the packed weight, plus bias: [..., n]."""
    if x.dim() == 2:  # the model's flat batch of tokens
        return torch.ops.kvserve.packed_linear(x, packed, n, bias)
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.kvserve.packed_linear(rows, packed, n, bias).reshape(*x.shape[:-1], n)


def register_fake() -> None:
    """The ops' output shapes for torch.compile's tracing (once the library that
    defines them is loaded)."""
    @torch.library.register_fake("kvserve::packed_linear")
    def _(x, weight, n, bias):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kvserve::paged_decode")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

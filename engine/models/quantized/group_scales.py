"""Group scales kept as two float16 factors (GGUF's K-quants: a sub-block scale under
a super-block one spanning 256 inputs), multiplied in float32 when the weights are
expanded: the same product gguf computes, so nothing rounds."""
from __future__ import annotations

import torch


def group_values(fine: torch.Tensor | None, base: torch.Tensor | None,
                 dim: int) -> torch.Tensor | None:
    """fine [.., groups, ..] times base [.., groups / per_base, ..] repeated along
    `dim`, in float32; fine alone where there is no base."""
    if fine is None:
        return None
    if base is None:
        return fine.float()
    return fine.float() * base.float().repeat_interleave(fine.shape[dim] // base.shape[dim],
                                                         dim=dim)

"""The batched LoRA product of one projection over a flat step (the Punica idea):
every token carries the slot of its request's adapter (-1: none), adapters sit in
fixed stacked buffers (A [slots, r_max, in], B transposed [slots, r_max, out],
zero-padded to the largest rank, so shapes never depend on which adapters are
loaded), and each token gets x @ A[slot].T @ B[slot] added: shrink to the rank,
then expand.

This is the torch reference: one shrink and one expand per adapter present, over
its tokens (a segment of the sorted batch), none at all when no token has one."""
from __future__ import annotations

import torch


def add_lora(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
             b_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y [T, out] += the LoRA delta of x [T, in] for each token's slot; returns y."""
    present = torch.unique(slots)
    for slot in present[present >= 0].tolist():
        rows = (slots == slot).nonzero(as_tuple=True)[0]
        shrunk = x[rows] @ a_stack[slot].T  # [n, r]
        y.index_add_(0, rows, (shrunk @ b_stack[slot]).to(y.dtype))
    return y

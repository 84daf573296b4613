"""Batch-1 decode on CPU over bfloat16 copies of float32 weights.

A batch-1 decode step reads every weight once for one row: its time is the bytes it
reads (float32 ran at 85% of its memory floor on an AVX2 CPU,
bench/results/cpu_profile_avx2_2026-11-25.md). Where a float32 weight holds exact
bfloat16 values (a bf16 checkpoint served in float32 because the CPU has no native
bf16, as --dtype auto does on AVX2), a bf16 copy holds the same numbers in half the
bytes. The batch-1 compiled graph reads that copy, widened to float32 as each value
is loaded inside Inductor's reduction loop (exact: a bf16 value is a float32 with
16 zero bits), and sums in float32 as before: only the order of the additions
changes. Batches keep the float32 weights, since torch's bf16 GEMM has no native
bf16 there (2.8x slower at 16 rows on AVX2). The price: half as much memory again
for every copied weight.

Inductor's freezing folds any function of a weight alone into a new constant, the
widened float32 weight among them: the batch-1 graph is compiled with dtype
conversions kept out of constant folding (`conversions_kept`)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor import constant_folding

# What `.float()` is traced to; nothing else the decoder does converts a weight.
_CONVERSION = torch.ops.prims.convert_element_type.default


class Linear(nn.Linear):
    """nn.Linear whose batch-1 compiled decode reads `bf16_weight` where it is set
    (add_bf16_copies)."""
    bf16_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only while Dynamo traces a graph of one row: eagerly, the widening below
        # would write the whole float32 weight out before reading it again.
        if (self.bf16_weight is not None and torch.compiler.is_compiling()
                and x.shape[0] == 1):
            y = (x.unsqueeze(-2) * self.bf16_weight.float()).sum(-1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def add_bf16_copies(model: nn.Module) -> int:
    """A bf16 copy beside every float32 `Linear` weight that holds exact bf16 values;
    returns the bytes they take."""
    added = 0
    for module in model.modules():
        w = module.weight if isinstance(module, Linear) else None
        if w is None or w.dtype != torch.float32 or w.device.type != "cpu":
            continue
        narrow = w.detach().to(torch.bfloat16)
        if torch.equal(narrow.float(), w):
            module.bf16_weight = narrow
            added += narrow.numel() * narrow.element_size()
    return added


def has_bf16_copies(model: nn.Module) -> bool:
    return any(getattr(m, "bf16_weight", None) is not None for m in model.modules())


def bytes_saved_at_batch_one(model: nn.Module) -> int:
    """How many fewer weight bytes a batch-1 decode step reads through the copies."""
    return sum(m.weight.nbytes - m.bf16_weight.nbytes for m in model.modules()
               if getattr(m, "bf16_weight", None) is not None)


@contextlib.contextmanager
def conversions_kept():
    """While a graph is compiled in this block, freezing folds no dtype conversion
    of a weight into a constant of its own (process-wide, so only around the
    compilation of the graph that reads the copies)."""
    constant_folding.add_dont_constant_fold(_CONVERSION)
    try:
        yield
    finally:
        constant_folding._dont_constant_fold.remove(_CONVERSION)

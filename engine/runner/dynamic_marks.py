"""Dynamo's marks on a compiled step's inputs: which dimensions may vary from call to
call without a recompilation (compiled_model.py's graphs). Dynamo would otherwise
specialise on the sizes of the first call, and on any dimension of 1 or 0."""
from __future__ import annotations

import torch

from kvserve.engine.kernels.attention.cpu_paged import PagedDecode
from kvserve.engine.models.lora_step import LoRAStep


def dynamic(ids: torch.Tensor, positions: torch.Tensor):
    """The row count of these inputs may vary (at least 2) without a recompilation."""
    for t in (ids, positions):
        torch._dynamo.mark_dynamic(t, 0)
    return ids, positions


def dynamic_paged(paged: PagedDecode | None) -> PagedDecode | None:
    """A decode step's batch size and table width may vary."""
    if paged is not None:
        for t, dims in ((paged.block_tables, (0, 1)), (paged.seq_lens, (0,)),
                        (paged.slots, (0,))):
            for dim in dims:
                torch._dynamo.mark_dynamic(t, dim)
        dynamic_groups(paged)
    return paged


def dynamic_groups(paged: PagedDecode | None, batch: bool = True) -> PagedDecode | None:
    """A hybrid model's layer groups' tables (and, batch: their rows and slots) vary
    as the full group's."""
    for tables, slots in paged.groups if paged is not None else ():
        torch._dynamo.mark_dynamic(tables, 1)
        if batch:
            for t in (tables, slots):
                torch._dynamo.mark_dynamic(t, 0)
    return paged


def dynamic_lora(lora: LoRAStep | None) -> LoRAStep | None:
    """A LoRA step's token count may vary."""
    if lora is not None:
        for t in (lora.token_slots, lora.mask):
            if t is not None:
                torch._dynamo.mark_dynamic(t, 0)
    return lora


def marking(fn):
    return lambda ids, positions, lora=None: fn(*dynamic(ids, positions),
                                               dynamic_lora(lora))

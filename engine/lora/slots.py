"""Resident adapters in fixed stacked buffers, laid out as the model reads them
(step.py): per projection group, A as [layers, projections, max_loras, max_rank, in]
and B transposed on a block diagonal, [layers, projections x max_loras x max_rank,
packed outputs]; zero-padded. A compiled step or a CUDA graph sees the same shapes
whichever adapters are loaded. When a step needs an adapter that is not resident,
the least recently used one the step does not need gives up its slot."""
from __future__ import annotations

from collections import OrderedDict

import torch

from kvserve.engine.lora.adapter import LoRAAdapter
from kvserve.engine.models.lora_step import GROUP_INDEX, GROUP_OF, GROUPS, projection_b


class NoFreeSlotError(RuntimeError):
    """A step needs more adapters than --max-loras (the scheduler never asks so)."""


class LoRASlots:
    def __init__(self, max_loras: int, max_rank: int, num_layers: int,
                 shapes: dict[str, tuple[int, int]], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """shapes: projection -> (in features, out features)."""
        self.max_loras, self.max_rank = max_loras, max_rank
        self.out_sizes = tuple(tuple(shapes[p][1] for p in ps) for ps in GROUPS.values())
        width = max_loras * max_rank

        def zeros(*shape):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.shrink = tuple(zeros(num_layers, len(ps), max_loras, max_rank, shapes[ps[0]][0])
                            for ps in GROUPS.values())
        self.expand = tuple(zeros(num_layers, len(ps) * width, sum(outs))
                            for ps, outs in zip(GROUPS.values(), self.out_sizes))
        self._resident: OrderedDict[str, int] = OrderedDict()  # key -> slot, LRU first

    def slot_of(self, key: str) -> int | None:
        return self._resident.get(key)

    def place(self, key: str, adapter: LoRAAdapter, keep: set[str] = frozenset()) -> int:
        """The adapter's slot, writing it there first if it is not resident (in a free
        slot, or the least recently used one not in `keep`)."""
        slot = self._resident.get(key)
        if slot is None:
            slot = self._free_slot(keep | {key})
            self._write(slot, adapter)
            self._resident[key] = slot
        self._resident.move_to_end(key)
        return slot

    def evict(self, key: str) -> None:
        """Frees the adapter's slot, if it has one (its stale weights stay until the
        slot is written again: no step reads a slot no token names)."""
        self._resident.pop(key, None)

    def views(self, projection: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One projection's (A [max_loras, max_rank, in], B [max_loras, max_rank,
        out]), views of the stacks."""
        group, j = GROUP_OF[projection]
        g = GROUP_INDEX[group]
        return (self.shrink[g][layer, j],
                projection_b(self.expand[g][layer], j, self.max_loras, self.max_rank,
                             self.out_sizes[g]))

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self._resident.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next((k for k in self._resident if k not in keep), None)
        if victim is None:
            raise NoFreeSlotError(f"a step needs more than {self.max_loras} adapters "
                                  "(--max-loras)")
        return self._resident.pop(victim)

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        num_layers = self.shrink[0].shape[0]
        for layer in range(num_layers):  # every projection: zero where it has none
            for projection in GROUP_OF:
                a, b = self.views(projection, layer)
                a[slot].zero_()
                b[slot].zero_()
        r = adapter.rank
        for (layer, projection), (a, b) in adapter.weights.items():
            a_stack, b_stack = self.views(projection, layer)
            a_stack[slot, :r].copy_(a)
            b_stack[slot, :r].copy_(b.T)

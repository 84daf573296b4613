"""Resident adapters in fixed stacked buffers: for each layer and projection, A
[max_loras, max_rank, in] and B [max_loras, out, max_rank], zero-padded, so a compiled
step or a CUDA graph sees the same shapes whichever adapters are loaded. An adapter
is pinned while requests use it; when more are asked for than fit, the least
recently used unpinned one gives up its slot."""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.lora.adapter import TARGETS, LoRAAdapter


class NoFreeSlotError(RuntimeError):
    """Every slot holds an adapter that running requests use: the request waits."""


class LoRASlots:
    def __init__(self, max_loras: int, max_rank: int, num_layers: int,
                 shapes: dict[str, tuple[int, int]], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.a = {(layer, m): torch.zeros(max_loras, max_rank, shapes[m][0], dtype=dtype,
                                          device=device)
                  for layer in range(num_layers) for m in TARGETS}
        self.b = {(layer, m): torch.zeros(max_loras, shapes[m][1], max_rank, dtype=dtype,
                                          device=device)
                  for layer in range(num_layers) for m in TARGETS}
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, LRU first
        self._pins: dict[str, int] = {}  # name -> requests using it

    def slot_of(self, name: str) -> int | None:
        return self._resident.get(name)

    def acquire(self, adapter: LoRAAdapter) -> int:
        """The adapter's slot, loading it (evicting the least recently used unpinned
        adapter if none is free), pinned until release()."""
        slot = self._resident.get(adapter.name)
        if slot is None:
            slot = self._free_slot()
            self._write(slot, adapter)
            self._resident[adapter.name] = slot
        self._resident.move_to_end(adapter.name)
        self._pins[adapter.name] = self._pins.get(adapter.name, 0) + 1
        return slot

    def release(self, name: str) -> None:
        left = self._pins.get(name, 0) - 1
        if left < 0:
            raise RuntimeError(f"adapter {name!r} released more often than acquired")
        self._pins[name] = left

    def evict(self, name: str) -> None:
        """Drops a resident adapter that no request uses (an unload)."""
        if self._pins.get(name):
            raise RuntimeError(f"adapter {name!r} is in use by {self._pins[name]} requests")
        self._resident.pop(name, None)
        self._pins.pop(name, None)

    def _free_slot(self) -> int:
        used = set(self._resident.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next((n for n in self._resident if not self._pins.get(n)), None)
        if victim is None:
            raise NoFreeSlotError(f"all {self.max_loras} adapter slots (--max-loras) are "
                                  "in use by running requests")
        return self._resident.pop(victim)

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for key in self.a:  # every projection: zero where the adapter has none
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
        r = adapter.rank
        for key, (a, b) in adapter.weights.items():
            self.a[key][slot, :r].copy_(a)
            self.b[key][slot, :, :r].copy_(b)

"""The engine's adapters: registered by name (their weights read into host memory
once), the ones a step needs resident in LoRASlots on the model's device.

A request holds its adapter's key, the name plus a load serial, never the name
itself: the prefix cache is keyed by it, and an adapter unloaded and loaded again
under the same name is another adapter whose blocks never hit the old one's. An
unloaded adapter leaves the registry at once (new requests for it are refused) and
its weights stay until the last request using it has ended."""
from __future__ import annotations

import itertools
import logging

import torch

from kvserve.engine.platform.host_copy import to_device
from kvserve.engine.lora.adapter import (LoRAAdapter, LoRAAdapterError, load_adapter,
                                         projection_shapes)
from kvserve.engine.config.lora_config import LoRAConfig
from kvserve.engine.lora.slots import LoRASlots
from kvserve.engine.models.lora_step import LoRAStep, slot_mask

log = logging.getLogger("kvserve.lora")


class LoRAManager:
    def __init__(self, config: LoRAConfig, model_config, device: torch.device,
                 dtype: torch.dtype, kernels: str = "auto"):
        """kernels: "dense" (the masked matmuls), "triton" (the BGMV kernels), or
        "auto": triton on CUDA, dense elsewhere."""
        self.config = config
        self.num_layers = model_config.num_layers
        self.shapes = projection_shapes(model_config)
        # A mixture-of-experts layer has no dense MLP for an adapter to add to.
        moe = model_config.moe
        self.sparse_layers = frozenset(
            i for i in range(self.num_layers) if moe is not None and moe.is_sparse(i))
        self.slots = LoRASlots(config.max_loras, config.max_rank, self.num_layers,
                               self.shapes, dtype, device)
        self.device, self.dtype = device, dtype
        self.dense = device.type != "cuda" if kernels == "auto" else kernels == "dense"
        self._keys: dict[str, str] = {}  # served name -> key
        self._adapters: dict[str, LoRAAdapter] = {}  # key -> adapter (retired ones too)
        self._serial = itertools.count(1)
        for name, path in config.modules:
            self.load(name, path)

    # -- the registry ----------------------------------------------------------------
    def load(self, name: str, path: str, replace: bool = False) -> None:
        """Reads, checks and registers the adapter; raises LoRAAdapterError (nothing
        changes)."""
        self.check_room(name, replace)
        self.register(name, self.read(name, path), replace)

    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter read from disk and checked against the model: touches none of
        the manager's state, so it may run on a thread of its own while steps run."""
        return load_adapter(name, path, self.config.max_rank, self.num_layers, self.shapes,
                            sparse_layers=self.sparse_layers)

    def check_room(self, name: str, replace: bool) -> None:
        """LoRAAdapterError if `name` may not be loaded now: taken (without replace),
        or --max-cpu-loras adapters loaded already."""
        if name in self._keys and not replace:
            raise LoRAAdapterError(f"the LoRA adapter {name!r} has already been loaded")
        if name not in self._keys and len(self._keys) >= self.config.max_cpu_loras:
            raise LoRAAdapterError(f"{len(self._keys)} LoRA adapters are loaded, the most "
                                   f"this server keeps (--max-cpu-loras); unload one first")

    def register(self, name: str, adapter: LoRAAdapter, replace: bool = False) -> None:
        """Serves an adapter read by `read` under `name`. replace: a loaded adapter of
        that name gives it up (requests using it finish with it)."""
        self.check_room(name, replace)
        path = adapter.path
        key = f"{name}@{next(self._serial)}"
        self._keys[name], self._adapters[key] = key, adapter
        log.info("LoRA adapter %r loaded from %s (rank %d, %s)", name, path, adapter.rank,
                 ", ".join(sorted(adapter.targets)))

    def unload(self, name: str) -> None:
        """Raises KeyError for a name not loaded. Requests already holding the
        adapter finish with it (see retire)."""
        del self._keys[name]
        log.info("LoRA adapter %r unloaded", name)

    def key_of(self, name: str) -> str | None:
        return self._keys.get(name)

    @property
    def names(self) -> dict[str, str]:
        """Served name -> the path it was loaded from."""
        return {name: str(self._adapters[key].path) for name, key in self._keys.items()}

    @property
    def retiring(self) -> bool:
        """Are unloaded adapters' weights still kept for requests using them?"""
        return len(self._adapters) > len(self._keys)

    def retire(self, in_use: set[str | None]) -> None:
        """Drops the weights and slots of unloaded adapters no request uses any more
        (in_use: the keys of every request still known)."""
        live = set(self._keys.values()) | in_use
        for key in [k for k in self._adapters if k not in live]:
            del self._adapters[key]
            self.slots.evict(key)

    # -- one step --------------------------------------------------------------------
    def step_inputs(self, keys: list[str | None], lens: list[int]) -> LoRAStep | None:
        """The step's LoRA inputs for requests with these adapter keys (None: the
        base model) computing `lens` tokens each, in the flat batch's order; None
        when no request has an adapter."""
        token_slots = self.token_slots(keys, lens)
        return None if token_slots is None else self.inputs(token_slots)

    def token_slots(self, keys: list[str | None], lens: list[int]) -> torch.Tensor | None:
        """Each token's adapter slot ([T] int32, -1: none) on the device, as
        step_inputs; None when no request has an adapter. Loads the adapters not
        resident, in the slots of the least recently used ones the step does not
        need."""
        present = {k for k in keys if k is not None}
        if not present:
            return None
        slot = {key: self.slots.place(key, self._adapters[key], keep=present)
                for key in present}
        per_token = [-1 if k is None else slot[k] for k, n in zip(keys, lens) for _ in range(n)]
        return to_device(per_token, torch.int32, self.device)

    def warm_up_inputs(self, num_tokens: int, per_token: bool = False) -> LoRAStep:
        """Every token through slot 0, whatever it holds: for compiling the graphs
        that take adapters (their output is thrown away)."""
        step = self.inputs(torch.zeros(num_tokens, dtype=torch.int32, device=self.device))
        return step.gathered() if per_token else step

    def inputs(self, token_slots: torch.Tensor) -> LoRAStep:
        """A step's LoRA inputs from each token's slot (the dense path's mask is
        computed from them, on the device)."""
        mask = (slot_mask(token_slots, self.slots.max_loras, self.slots.max_rank, self.dtype)
                if self.dense else None)
        return LoRAStep(self.slots.shrink, self.slots.expand, self.slots.out_sizes,
                        token_slots, mask)


def lora_manager(manager: LoRAManager | None) -> LoRAManager:
    """The engine's adapters, or the ValueError of an engine serving none."""
    if manager is None:
        raise ValueError("LoRA adapters are not enabled: start the server with "
                         "--enable-lora")
    return manager


def lora_key(manager: LoRAManager | None, name: str | None) -> str | None:
    """The key a request for adapter `name` runs under (None: the base model);
    ValueError for an adapter not loaded."""
    if name is None:
        return None
    key = lora_manager(manager).key_of(name)
    if key is None:
        raise ValueError(f"the LoRA adapter {name!r} is not loaded")
    return key


def adapter_names(keys) -> tuple[str, ...]:
    """The served names of these adapter keys (None: the base model, left out)."""
    return tuple(sorted({key.rpartition("@")[0] for key in keys if key is not None}))

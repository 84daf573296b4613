"""LoRA adapters loaded and unloaded while the engine serves (the engine's side of
/v1/load_lora_adapter): read on any thread, registered between steps, and a replaced
or unloaded adapter retired once no request uses it."""
from __future__ import annotations

from kvserve.engine.lora.adapter import LoRAAdapter
from kvserve.engine.lora.manager import lora_manager


class RuntimeAdapters:
    """Mixed into Engine, whose `lora` (LoRAManager or None), `scheduler` and
    `grammars` it reads."""

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Raises LoRAAdapterError (a ValueError) for an adapter it cannot serve.
        replace: the name may be taken (its adapter retires once the new one loads)."""
        self.register_lora(name, self.read_lora(name, path, replace), replace)

    def read_lora(self, name: str, path: str, replace: bool = False) -> LoRAAdapter:
        """The adapter read from disk and checked (LoRAAdapterError if it cannot be
        served, or could not be loaded now): safe on a thread beside the steps
        (engine/client/engine_loop.py reads there), it changes nothing."""
        lora_manager(self.lora).check_room(name, replace)
        return lora_manager(self.lora).read(name, path)

    def register_lora(self, name: str, adapter: LoRAAdapter, replace: bool = False) -> None:
        """Serves an adapter read_lora returned, between steps."""
        lora_manager(self.lora).register(name, adapter, replace)
        self._retire_adapters()

    def unload_lora(self, name: str) -> None:
        """Raises KeyError for a name not loaded; requests using it finish with it."""
        lora_manager(self.lora).unload(name)
        self._retire_adapters()

    def _retire_adapters(self) -> None:
        if self.lora is not None and self.lora.retiring:
            running, waiting = self.adapters_in_use(self.scheduler.stats())
            self.lora.retire(running | waiting)

    def adapters_in_use(self, stats) -> tuple[frozenset, frozenset]:
        """The LoRA adapter keys of running requests and of waiting ones (a grammar
        still compiling counts as waiting), from the scheduler's `stats`."""
        held = self.grammars.held() if self.grammars is not None else []
        return stats.lora_running, stats.lora_waiting | {r.lora for r in held}

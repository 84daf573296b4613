"""Multi-LoRA serving's settings (--enable-lora and the flags beside it), as vLLM
names them."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from kvserve.engine.config.arg_types import parse_bool, positive_int
from kvserve.engine.config.settings import setting


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ...}`, -> (name, path):
    the name requests give as their `model`."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            name, path = str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f'expected {{"name": ..., "path": ...}}, got {text!r}') from None
    else:
        name, _, path = text.partition("=")
    if not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name.strip(), path.strip()


@dataclass(frozen=True)
class LoRAConfig:
    enable: bool = setting(False, "serve LoRA adapters over the base model, chosen by "
                           "a request's `model`", flag="--enable-lora", parse=parse_bool)
    modules: tuple[tuple[str, str], ...] = setting(
        (), "adapters served from the start, as name=path (PEFT adapter directories: "
        "adapter_config.json and adapter_model.safetensors)", flag="--lora-modules",
        parse=parse_lora_module, many=True)
    # Each resident adapter costs a slot in every targeted projection's stacked
    # buffers (max_loras x max_lora_rank x (in + out) values per projection).
    max_loras: int = setting(1, "adapters resident at once (requests of others wait); "
                             "each step's LoRA work grows with it on CPU",
                             flag="--max-loras", parse=positive_int)
    max_rank: int = setting(16, "highest adapter rank accepted", flag="--max-lora-rank",
                            parse=positive_int)
    # Every loaded adapter's weights stay in host memory (vLLM's name; its LRU evicts
    # past it, kvserve refuses the load: the client decides which to unload).
    max_cpu_loras: int = setting(64, "adapters loaded at once (in host memory; resident "
                                 "on the device: --max-loras); a load past it is refused "
                                 "until one is unloaded", flag="--max-cpu-loras",
                                 parse=positive_int)

    @classmethod
    def from_settings(cls, enable: bool, modules, **rest) -> LoRAConfig | None:
        """From the flags: None (LoRA off) without --enable-lora."""
        if not enable:
            if modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return None
        return cls(True, tuple(modules or ()), **rest)

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        if self.max_cpu_loras < max(self.max_loras, len(self.modules)):
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                             f"--max-loras ({self.max_loras}) and the number of "
                             f"--lora-modules ({len(self.modules)})")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")

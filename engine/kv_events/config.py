"""--kv-events-config: vLLM's JSON object, the same keys and defaults."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # zmq | null (recorded, published nowhere)
    endpoint: str = "tcp://*:5557"  # bound; subscribers connect
    replay_endpoint: str | None = None  # a ROUTER socket resending buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark: beyond it a slow subscriber loses batches
    max_queue_size: int = 100_000  # batches waiting for the publishing thread
    topic: str = ""

    @staticmethod
    def parse(text: str) -> "KVEventsConfig":
        """From the flag's JSON text; ValueError names an unknown key."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(KVEventsConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        config = KVEventsConfig(**values)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be zmq or null, got "
                             f"{config.publisher!r}")
        return config

"""--kv-events-config: vLLM's JSON object, the same keys and defaults."""
from __future__ import annotations

import argparse
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
        """From --kv-events-config's JSON text; ValueError says what is wrong."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise ValueError("not a JSON object")
        known = {f.name for f in fields(KVEventsConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        config = KVEventsConfig(**values)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be zmq or null, got "
                             f"{config.publisher!r}")
        return config


def parse_flag(text: str) -> KVEventsConfig:
    """KVEventsConfig.parse for the flag and its variable: argparse shows the reason."""
    try:
        return KVEventsConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc

"""--kv-events-config: vLLM's JSON object, its keys and defaults, but for two choices
that keep tenants' prompts off the network unless the operator asks otherwise.

The events carry the token ids of every block cached, whoever sent them, so:
- the endpoint binds loopback by default (vLLM's binds `tcp://*:5557`): a router on
  another host needs `"endpoint": "tcp://*:5557"` (or an interface's address), and
  the network path to it should admit the router only (deploy/k8s/networkpolicy.yaml);
- `include_token_ids` (kvserve's own key; true, as vLLM sends them) false sends
  BlockStored with `token_ids: []`, for routers that track block hashes alone.
  vllm-router's kv_aware policy is not one of them: it indexes blocks by hashes of
  their token ids, so it finds nothing without them."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvserve.engine.config.arg_types import json_fields

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # zmq | null (recorded, published nowhere)
    endpoint: str = DEFAULT_ENDPOINT  # bound; subscribers connect
    replay_endpoint: str | None = None  # a ROUTER socket resending buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ high-water mark: beyond it a slow subscriber loses batches
    max_queue_size: int = 100_000  # batches waiting for the publishing thread
    topic: str = ""
    include_token_ids: bool = True  # false: BlockStored's token_ids always []

    @staticmethod
    def parse(text: str) -> "KVEventsConfig":
        """From --kv-events-config's JSON text; ValueError says what is wrong."""
        values = json_fields(text, KVEventsConfig)
        # A string "false" would be truthy: the tokens would go out while the
        # operator believes they do not.
        if not isinstance(values.get("include_token_ids", True), bool):
            raise ValueError("include_token_ids must be true or false")
        config = KVEventsConfig(**values)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be zmq or null, got "
                             f"{config.publisher!r}")
        return config


def binds_every_interface(endpoint: str) -> bool:
    """tcp://*:port, tcp://0.0.0.0:port, tcp://[::]:port: reachable from the network."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host in ("*", "0.0.0.0", "[::]", "::")


def parse_flag(text: str) -> KVEventsConfig:
    """KVEventsConfig.parse for the flag and its variable: argparse shows the reason."""
    try:
        return KVEventsConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc

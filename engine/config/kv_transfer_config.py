"""--kv-transfer-config: vLLM's JSON object for prefill/decode disaggregation, the
keys a MooncakeConnector deployment passes (engine/kv_transfer/ does the moving).

    {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}   # prefill
    {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}   # decode

kv_both does either, as the request's kv_transfer_params say (vLLM's meaning).
kv_ip is the address this instance's side channel and transfer engine listen on and
tell the other instance: 127.0.0.1 by default (vLLM's too), so a prompt's KV never
leaves the host unless the operator names an interface. kv_port 0 picks a free port
(the prefill's answer carries it to the decode side, through the router)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvserve.engine.config.arg_types import json_fields

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("MooncakeConnector",)
# How long a finished prefill keeps its prompt's blocks for a decode instance that
# has not fetched them (then they go back to the prefix cache: a decode instance
# that died leaks nothing). vLLM's Mooncake connector waits 480 s; a minute covers a
# router's hop and a decode queue's wait, and pins far less memory behind a crash.
DEFAULT_HOLD_TIMEOUT_S = 60.0
# How long a decode instance waits for the prefill's side channel and the copy
# before it computes the prompt itself.
DEFAULT_FETCH_TIMEOUT_S = 30.0
EXTRA_KEYS = {"hold_timeout_s": DEFAULT_HOLD_TIMEOUT_S,
              "fetch_timeout_s": DEFAULT_FETCH_TIMEOUT_S, "protocol": "tcp"}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "MooncakeConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0  # the side channel's port (0: any free one)
    engine_id: str | None = None  # None: a random one per start
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str):
        return self.kv_connector_extra_config.get(key, EXTRA_KEYS[key])

    @staticmethod
    def parse(text: str) -> "KVTransferConfig":
        """From --kv-transfer-config's JSON text; ValueError says what is wrong."""
        config = KVTransferConfig(**json_fields(text, KVTransferConfig))
        if config.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {list(CONNECTORS)}, got "
                             f"{config.kv_connector!r}")
        if config.kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {list(ROLES)}, got {config.kv_role!r}")
        if not isinstance(config.kv_ip, str) or not (
                config.engine_id is None or isinstance(config.engine_id, str)):
            raise ValueError("kv_ip and engine_id must be strings")
        if not isinstance(config.kv_port, int) or not 0 <= config.kv_port < 65536:
            raise ValueError(f"kv_port must be a port number, got {config.kv_port!r}")
        _check_extra(config.kv_connector_extra_config)
        return config


def _check_extra(extra) -> None:
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: "
                         f"{sorted(EXTRA_KEYS)}")
    for key in ("hold_timeout_s", "fetch_timeout_s"):
        value = extra.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{key} must be a positive number of seconds")
    if extra.get("protocol", "tcp") not in ("tcp", "rdma"):
        raise ValueError("protocol must be tcp or rdma")


def parse_flag(text: str) -> KVTransferConfig:
    """KVTransferConfig.parse for the flag and its variable: argparse shows the reason."""
    try:
        return KVTransferConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc

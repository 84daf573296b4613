"""Mooncake's transfer engine, the few calls this package makes: register a memory
range for remote reads, read ranges of a peer's registered memory into ours. One
engine per instance; its RPC port is the session name a peer reads through.

Over "tcp" (the default, and all a CPU host has) the engine copies through its own
sockets; over "rdma" the NIC reads the peer's memory (device memory on a CUDA build
of Mooncake, `mooncake-transfer-engine`). Whoever can reach the engine's port can
read what is registered (SECURITY.md): kv_ip is loopback unless the operator names
a private interface."""
from __future__ import annotations

import logging
import os
import threading

from kvserve.modelstore.errors import ModelLoadError

log = logging.getLogger("kvserve.kv_transfer")


def _import_transfer_engine():
    os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO lines drown the server's
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ModelLoadError(
            "--kv-transfer-config's MooncakeConnector needs Mooncake's transfer engine: "
            "pip install 'kvserve[pd]' (mooncake-transfer-engine on a CUDA host; it "
            f"needs libibverbs1 either way): {exc}") from None
    return TransferEngine


def check_device_memory(device_type: str) -> None:
    """A KV cache in GPU memory needs Mooncake's CUDA build to register it: the
    CPU-only wheel would read device addresses as host ones."""
    from importlib import metadata

    try:
        metadata.version("mooncake-transfer-engine")
        return
    except metadata.PackageNotFoundError:
        pass
    if device_type != "cpu":
        raise ModelLoadError(f"--kv-transfer-config with a KV cache on {device_type} "
                             "needs Mooncake's CUDA build: pip install "
                             "mooncake-transfer-engine (mooncake-transfer-engine-non-cuda "
                             "reads host memory only)")


class MooncakeTransport:
    def __init__(self, host: str, protocol: str = "tcp"):
        engine = _import_transfer_engine()()
        # P2PHANDSHAKE: peers find each other by host:port, no metadata server.
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise ModelLoadError(f"Mooncake's transfer engine did not start on {host} "
                                 f"over {protocol} (rc {rc})")
        self._engine = engine
        self.session = f"{host}:{engine.get_rpc_port()}"
        self._lock = threading.Lock()  # registrations come from the fetch threads

    def register(self, address: int, nbytes: int) -> None:
        with self._lock:
            rc = self._engine.register_memory(address, nbytes)
        if rc != 0:
            raise RuntimeError(f"registering {nbytes} bytes for KV transfer failed (rc {rc})")

    def unregister(self, address: int) -> None:
        with self._lock:
            self._engine.unregister_memory(address)

    def read(self, peer_session: str, local: list[int], remote: list[int],
             lengths: list[int]) -> None:
        """Copies each remote range into the local one (registered), all at once;
        RuntimeError when the peer is gone or refuses."""
        rc = self._engine.batch_transfer_sync_read(peer_session, local, remote, lengths)
        if rc != 0:
            raise RuntimeError(f"reading {len(lengths)} KV ranges from {peer_session} "
                               f"failed (rc {rc})")

"""What the engine loop calls (engine/client/engine_loop.py): one object per engine
run with --kv-transfer-config, its producer side, its consumer side, or both as
kv_role says. Built after the engine, whose KV cache it registers for reading
(producer) and whose second tier it fills (consumer)."""
from __future__ import annotations

import logging

from kvserve.engine.kv_offload.host_tier import cache_tensors
from kvserve.engine.kv_transfer import block_layout
from kvserve.engine.kv_transfer.consumer import RemotePrefills
from kvserve.engine.kv_transfer.producer import PrefillHolds
from kvserve.engine.kv_transfer.transport import MooncakeTransport, check_device_memory

log = logging.getLogger("kvserve.kv_transfer")

# How often an idle loop looks at fetches (their requests wait for it) and holds.
FETCH_POLL_S = 0.005
HOLD_POLL_S = 0.5


class KVTransferConnector:
    def __init__(self, engine):
        config = engine.config.kv_transfer_config
        tensors = cache_tensors(engine.runner.all_kv_caches)
        fingerprint = block_layout.fingerprint(tensors, engine.config.block_size)
        if config.produces:  # the prefill side registers its KV cache itself
            check_device_memory(tensors[0].device.type)
        self.transport = MooncakeTransport(config.kv_ip, config.extra("protocol"))
        self.producer = self.consumer = None
        self._registered: list[int] = []
        if config.produces:
            for address, nbytes in block_layout.storages(tensors):
                self.transport.register(address, nbytes)
                self._registered.append(address)
            describe = {"layout": fingerprint,
                        "regions": [[r.base, r.stride, r.nbytes]
                                    for r in block_layout.regions(tensors)]}
            self.producer = PrefillHolds(engine, config, describe, self.transport.session)
        if config.consumes:
            self.consumer = RemotePrefills(engine, config, self.transport, fingerprint)
        log.info("KV transfer (%s, %s): transfer engine at %s%s", config.kv_connector,
                 config.kv_role, self.transport.session,
                 f", side channel at {config.kv_ip}:{self.producer.port}"
                 if self.producer is not None else "")

    def defer(self, command) -> bool:
        """Whether an arriving request waits for a prefill's KV (ready() adds it)."""
        return self.consumer is not None and self.consumer.take(command)

    def added(self, command) -> None:
        if self.producer is not None:
            self.producer.expect(command)

    def abort(self, request_id: str, index: int | None):
        return self.consumer.abort(request_id, index) if self.consumer is not None else None

    def ready(self) -> list[tuple]:
        if self.producer is not None:
            self.producer.poll()
        return self.consumer.ready() if self.consumer is not None else []

    def on_outputs(self, outputs: list) -> None:
        if self.producer is not None and outputs:
            self.producer.on_outputs(outputs)

    def wait_hint(self) -> float | None:
        """The longest an idle loop may wait for a command (None: no limit)."""
        if self.consumer is not None and self.consumer.pending:
            return FETCH_POLL_S
        if self.producer is not None and self.producer.pending:
            return HOLD_POLL_S
        return None

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        if self.producer is not None:
            self.producer.close()
        for address in self._registered:
            self.transport.unregister(address)

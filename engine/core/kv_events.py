"""Publishes the prefix cache's events as vLLM does, so that routers consuming vLLM's
events (vllm-router's kv_aware policy, llm-d's precise prefix-cache scorer, Dynamo's
KV router) route to kvserve: a ZMQ PUB socket sends each step's events as one
msgpack EventBatch, in a three-frame message (topic, sequence number as 8
big-endian bytes, payload). The encoding is vLLM 0.29's (msgspec structs): the
batch an array [ts, events], each event a map tagged by "type": {"type":
"BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
"lora_id", "medium", "lora_name"}, {"type": "BlockRemoved", "block_hashes",
"medium"} or {"type": "AllBlocksCleared"}. Block hashes go out as 64-bit integers
(the last 8 bytes of our sha256 chain hashes), as vLLM sends its own by default.
With include_token_ids false, BlockStored's token_ids is [] (the key stays: vLLM's
BlockStored has no default for it, so its decoders need it).

Encoding and sending happen on a thread of their own: the engine's step only
queues the events. With replay_endpoint, a ROUTER socket answers a subscriber that
missed batches (it sends the first sequence number it wants) with the buffered
batches from there on, then sequence -1."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from kvserve.engine.config.kv_events_config import KVEventsConfig, binds_every_interface
from kvserve.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

log = logging.getLogger("kvserve.kv_events")

MEDIUM = "GPU"  # vLLM's name for the device tier of its cache, whatever the device
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def external_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


def encode_event(event: KVCacheEvent, token_ids: bool = True) -> dict:
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return {"type": "BlockStored",
                "block_hashes": [external_hash(h) for h in event.block_hashes],
                "parent_block_hash": None if parent is None else external_hash(parent),
                "token_ids": event.token_ids if token_ids else [],
                "block_size": event.block_size,
                "lora_id": None, "medium": MEDIUM, "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved",
                "block_hashes": [external_hash(h) for h in event.block_hashes],
                "medium": MEDIUM}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(events: list[KVCacheEvent], ts: float, token_ids: bool = True) -> bytes:
    return msgpack.packb([ts, [encode_event(e, token_ids) for e in events]])


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig):
        self.config = config
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events",
                                        daemon=True)
        self._thread.start()
        log.info("KV cache events on %s (topic %r)", config.endpoint, config.topic)
        open_to_all = [e for e in (config.endpoint, config.replay_endpoint)
                       if e is not None and binds_every_interface(e)]
        if config.include_token_ids and open_to_all:
            log.warning("KV cache events on %s carry the token ids of every tenant's "
                        "prompts to whoever connects: let only the router reach them, "
                        "or set include_token_ids false if the router needs hashes only",
                        " and ".join(open_to_all))

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queues one step's events (never blocks the step: a full queue drops them,
        which a subscriber sees as a gap in the sequence numbers)."""
        if events:
            try:
                self._queue.put_nowait((time.time(), events))
            except queue.Full:
                log.warning("KV event queue full: a batch of %d events dropped", len(events))

    def _run(self) -> None:
        topic = self.config.topic.encode()
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:  # idle: still answer replays
                self._answer_replays()
                continue
            if item is None:
                break
            payload = encode_batch(item[1], item[0], self.config.include_token_ids)
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((topic, seq, payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1
            self._answer_replays()
        self._pub.close(linger=1000)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _answer_replays(self) -> None:
        while self._replay is not None and self._replay.poll(0):
            identity, _, start = self._replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"),
                                                 payload))
            self._replay.send_multipart((identity, b"", _END_OF_REPLAY, b""))

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(5)


def make_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """None unless events are on and go somewhere (publisher "null": recorded by
    nobody, so the pool records nothing either)."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return None
    return ZmqEventPublisher(config)

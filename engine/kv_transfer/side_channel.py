"""The side channel a decode instance asks a prefill instance over: which blocks
hold a transfer's prompt and where they lie ("fetch"), and that it has read them
("done"). ZMQ request/reply, msgpack; the prefill side answers on a thread of its
own from a table the engine loop fills (producer.py), so a slow network never
holds up a step.

Who may ask: whoever reaches kv_ip:kv_port, which is why kv_ip is loopback by
default; a fetch names a transfer id (128 random bits, handed to the router in the
prefill's answer), so a peer can read only the transfers it was told of."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgpack
import zmq

log = logging.getLogger("kvserve.kv_transfer")

MAX_MESSAGE_BYTES = 1 << 22  # a fetch's answer: 65536 blocks' ids and hashes fit
_POLL_MS = 200  # how soon the serving thread sees a stop


class SideChannelServer:
    """Serves `answer(message) -> reply` (both dicts) on its own thread."""

    def __init__(self, host: str, port: int, answer: Callable[[dict], dict]):
        self._answer = answer
        self._socket = zmq.Context.instance().socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # requests are tiny
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvserve-kv-side-channel",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._socket
        while not self._stop.is_set():
            if not sock.poll(_POLL_MS):
                continue
            raw = sock.recv()
            try:
                message = msgpack.unpackb(raw)
                reply = (self._answer(message) if isinstance(message, dict)
                         else {"ok": False, "error": "not a message"})
            except Exception as exc:  # a malformed request must not end the thread
                log.warning("KV side channel: bad request: %s", exc)
                reply = {"ok": False, "error": "bad request"}
            sock.send(msgpack.packb(reply))
        sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def ask(host: str, port: int, message: dict, timeout_s: float) -> dict:
    """One request to a peer's side channel; TimeoutError when it does not answer."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgpack.packb(message))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"the prefill instance at {host}:{port} did not answer "
                               f"in {timeout_s:g} s")
        reply = msgpack.unpackb(sock.recv())
    finally:
        sock.close()
    if not isinstance(reply, dict):
        raise ValueError("the prefill instance's answer is not a message")
    return reply

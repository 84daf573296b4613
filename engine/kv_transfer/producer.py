"""The prefill instance's side: a request that asks for do_remote_decode runs as
any other (the router sends it with max_tokens 1); when it finishes, its prompt's
cached blocks are pinned under a fresh transfer id and its finishing output tells
the router where to find them. The decode instance fetches the block list over the
side channel, reads the blocks, and says done; the pins then go. A hold nobody
fetches ends after hold_timeout_s (a decode instance that died leaks nothing).

The engine loop's thread pins and unpins (the scheduler is its alone); the side
channel's thread only reads and marks the table below, under its lock."""
from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass

from kvserve.engine.kv_transfer.side_channel import SideChannelServer
from kvserve.engine.lora.manager import lora_key

log = logging.getLogger("kvserve.kv_transfer")

# At most this share of the KV cache is held for decode instances at once: past it
# a prefill answers with no blocks (the decode instance computes the prompt), so
# callers that ask for do_remote_decode and never fetch cannot starve the requests
# running here of blocks; each hold ends after hold_timeout_s anyway.
MAX_HELD_SHARE = 0.5


@dataclass
class _Hold:
    blocks: list[tuple[int, bytes]]  # (block id, hash), the prompt's order
    deadline: float
    released: bool = False


class PrefillHolds:
    def __init__(self, engine, config, describe: dict, session: str):
        self.engine, self.config = engine, config
        self._describe = describe  # the layout and regions every fetch's answer carries
        self._session = session  # the transfer engine's, which the decode side reads
        self._hold_s = float(config.extra("hold_timeout_s"))
        self._fetch_s = float(config.extra("fetch_timeout_s"))
        self._expected: dict = {}  # asked for do_remote_decode
        self._holds: dict[str, _Hold] = {}
        self._lock = threading.Lock()
        self.expired = 0  # holds given up on, never fetched (a metric's worth)
        self.refused = 0  # prompts not held: MAX_HELD_SHARE of the cache already was
        self._max_held = int(engine.context.num_blocks * MAX_HELD_SHARE)
        self._held = 0  # blocks pinned by the holds (the engine loop's thread alone)
        self._server = SideChannelServer(config.kv_ip, config.kv_port, self._answer)
        self.port = self._server.port
        self.engine_id = config.engine_id or secrets.token_hex(8)

    @property
    def pending(self) -> bool:
        return bool(self._holds)

    def expect(self, command) -> None:
        params = command.params.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._expected[command.request_id] = command

    def on_outputs(self, outputs: list) -> None:
        """Pins a finished prefill's blocks and attaches the hand-off to its output."""
        for out in outputs:
            if not out.finished or out.index != 0:
                continue
            command = self._expected.pop(out.request_id, None)
            if command is None or out.finish_reason in ("abort", "error"):
                continue
            blocks = self._pin(command)
            transfer_id = secrets.token_hex(16) if blocks else None  # None: nothing to read
            if blocks:
                with self._lock:
                    self._holds[transfer_id] = _Hold(blocks, time.monotonic() + self._hold_s)
            out.kv_transfer_params = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_host": self.config.kv_ip,
                "remote_port": self.port, "transfer_id": transfer_id,
                "remote_block_ids": [b for b, _ in blocks]}

    def _pin(self, command) -> list[tuple[int, bytes]]:
        scheduler = self.engine.scheduler
        blocks = scheduler.pin_prompt(command.prompt_token_ids, command.cache_salt,
                                      lora_key(self.engine.lora, command.lora_name))
        if self._held + len(blocks) > self._max_held:
            scheduler.unpin([b for b, _ in blocks])
            self.refused += 1
            log.warning("KV transfer: %d blocks already held for decode instances; "
                        "request %s is handed off without its KV", self._held,
                        command.request_id)
            return []
        self._held += len(blocks)
        return blocks

    def _unpin(self, hold: _Hold) -> None:
        self.engine.scheduler.unpin([b for b, _ in hold.blocks])
        self._held -= len(hold.blocks)

    def poll(self) -> None:
        """Unpins what was read or waited for too long (the engine loop's thread)."""
        now = time.monotonic()
        with self._lock:
            done = [t for t, h in self._holds.items() if h.released or h.deadline < now]
            ended = [self._holds.pop(t) for t in done]
        for hold in ended:
            if not hold.released:
                self.expired += 1
                log.warning("KV transfer: no decode instance read a prefill's %d blocks "
                            "in %g s; they go back to the prefix cache", len(hold.blocks),
                            self._hold_s)
            self._unpin(hold)

    def _answer(self, message: dict) -> dict:
        """The side channel's thread: a fetch or a done for one transfer id."""
        op, transfer_id = message.get("op"), message.get("id")
        with self._lock:
            hold = self._holds.get(transfer_id) if isinstance(transfer_id, str) else None
            if hold is None or hold.released or hold.deadline < time.monotonic():
                return {"ok": False, "error": "unknown or expired transfer"}
            if op == "done":
                hold.released = True
                return {"ok": True}
            if op != "fetch":
                return {"ok": False, "error": f"unknown op {op!r}"}
            # the read that follows must find the blocks still pinned
            hold.deadline = max(hold.deadline, time.monotonic() + 2 * self._fetch_s)
            blocks = [[b, h] for b, h in hold.blocks]
        return {"ok": True, "session": self._session, "blocks": blocks, **self._describe}

    def close(self) -> None:
        self._server.close()
        with self._lock:
            holds, self._holds = list(self._holds.values()), {}
        for hold in holds:
            self._unpin(hold)

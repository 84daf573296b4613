"""The decode instance's side: a request that arrives with do_remote_prefill (the
prefill's answer, passed on by the router) waits here, out of the scheduler, while
a fetch thread asks the prefill's side channel for its blocks and reads them with
one batch read into a packed buffer. Back on the engine loop's thread the blocks go
into the second KV tier under their hashes and the request is added as any other:
its prefix lookup finds them there (kvcache/second_tier.py) and only the prompt's
tail is computed. Blocks this instance has cached already are not read again.

Any failure (the prefill instance gone, a timeout, another layout, hashes that do
not match this instance's) is logged and the request is added as it came: it
computes its prompt itself. Nothing here touches the scheduler off the loop's
thread."""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvserve.engine.kv_transfer import block_layout
from kvserve.engine.kv_transfer.side_channel import ask
from kvserve.engine.lora.manager import lora_key
from kvserve.engine.platform.outputs import RequestOutput

log = logging.getLogger("kvserve.kv_transfer")

FETCH_THREADS = 4  # transfers in flight at once; each holds one packed buffer
# Ranges per batch read: Mooncake's transfer engine refuses a batch of 4800 (2048
# pass); consecutive blocks make one range per cache tensor, so a prompt rarely
# needs a second batch.
MAX_RANGES = 1024


@dataclass
class TransferStats:
    done: int = 0  # requests whose blocks were read
    failed: int = 0  # requests that computed their prompt instead
    blocks: int = 0  # blocks read from prefill instances


@dataclass
class _Pending:
    command: object  # the AddRequest (engine/client/messages.py) it holds back
    future: Future
    aborted: set = field(default_factory=set)  # sequence indexes aborted meanwhile


class RemotePrefills:
    def __init__(self, engine, config, transport, fingerprint: str):
        self.engine, self.tier, self.transport = engine, engine.runner.kv_tier, transport
        self._fingerprint = fingerprint
        self._timeout_s = float(config.extra("fetch_timeout_s"))
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kvserve-kv-fetch")
        self._pending: dict[str, _Pending] = {}
        self.stats = TransferStats()

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def take(self, command) -> bool:
        """Whether the request waits for its KV here (else it is added now)."""
        params = command.params.kv_transfer_params or {}
        if not (params.get("do_remote_prefill") and params.get("remote_host")
                and params.get("remote_port") and params.get("transfer_id")):
            return False
        scheduler = self.engine.scheduler
        hashes = scheduler.prompt_hashes(command.prompt_token_ids, command.cache_salt,
                                         lora_key(self.engine.lora, command.lora_name))
        have = scheduler.cached_prefix(hashes)
        peer = (params["remote_host"], params["remote_port"], params["transfer_id"])
        if have == len(hashes):  # nothing to read: every usable block is cached here
            self._pool.submit(self._release, *peer)
            return False
        future = self._pool.submit(self._fetch, *peer, hashes, have)
        self._pending[command.request_id] = _Pending(command, future)
        return True

    def abort(self, request_id: str, index: int | None) -> list[RequestOutput] | None:
        """None when the request is not waiting here; else the aborted sequences."""
        pending = self._pending.get(request_id)
        if pending is None:
            return None
        n = pending.command.params.n
        if index is not None and len(pending.aborted | {index}) < n:
            pending.aborted.add(index)
            return []  # aborted once it is added
        del self._pending[request_id]  # the fetch ends on its own; its result is dropped
        return [RequestOutput(request_id, i, finished=True, finish_reason="abort",
                              num_prompt_tokens=len(pending.command.prompt_token_ids))
                for i in range(n)]  # those aborted one by one before included

    def ready(self) -> list[tuple]:
        """The requests whose fetch ended, their blocks (if read) in the tier; each
        with the sequence indexes aborted while it waited."""
        out = []
        for request_id, pending in list(self._pending.items()):
            if not pending.future.done():
                continue
            del self._pending[request_id]
            try:
                got = pending.future.result()
            except Exception as exc:  # the prompt is computed here instead
                self.stats.failed += 1
                log.warning("KV transfer for %s failed, computing its prompt: %s",
                            request_id, exc)
            else:
                self._receive(*got)
            out.append((pending.command, pending.aborted))
        return out

    def _receive(self, hashes: list[bytes], packed: torch.Tensor) -> None:
        self.stats.done += 1
        self.stats.blocks += len(hashes)
        size = self.tier.block_bytes
        for j, block_hash in enumerate(hashes):
            self.tier.receive(block_hash, packed[j * size:(j + 1) * size])

    def _fetch(self, host: str, port: int, transfer_id: str, hashes: list[bytes],
               have: int) -> tuple[list[bytes], torch.Tensor]:
        """A fetch thread: the blocks past the first `have`, read and packed."""
        reply = ask(host, port, {"op": "fetch", "id": transfer_id}, self._timeout_s)
        try:
            if not reply.get("ok"):
                raise RuntimeError(f"the prefill instance refused: {reply.get('error')}")
            if reply.get("layout") != self._fingerprint:
                raise RuntimeError("the prefill instance's KV blocks have another layout "
                                   "(block size, dtype or model shape)")
            blocks = reply["blocks"]
            matched = 0
            while matched < min(len(blocks), len(hashes)) and \
                    blocks[matched][1] == hashes[matched]:
                matched += 1
            wanted = [b for b, _ in blocks[have:matched]]
            packed = torch.empty(len(wanted) * self.tier.block_bytes, dtype=torch.uint8)
            if wanted:
                packed = self._read(reply, wanted, packed)
            return hashes[have:have + len(wanted)], packed
        finally:
            self._release(host, port, transfer_id)

    def _release(self, host: str, port: int, transfer_id: str) -> None:
        """Tells the prefill it may unpin, whatever happened here."""
        try:
            ask(host, port, {"op": "done", "id": transfer_id}, min(self._timeout_s, 5.0))
        except Exception:
            pass  # its hold expires instead

    def _read(self, reply: dict, block_ids: list[int], packed: torch.Tensor) -> torch.Tensor:
        peer = [block_layout.Region(*r) for r in reply["regions"]]
        if sum(r.nbytes for r in peer) != self.tier.block_bytes:
            raise RuntimeError("the prefill instance's blocks are another size")
        local, remote, lengths = block_layout.block_reads(peer, block_ids, packed.data_ptr())
        self.transport.register(packed.data_ptr(), packed.numel())
        try:
            for at in range(0, len(lengths), MAX_RANGES):
                self.transport.read(reply["session"], local[at:at + MAX_RANGES],
                                    remote[at:at + MAX_RANGES], lengths[at:at + MAX_RANGES])
        finally:
            self.transport.unregister(packed.data_ptr())
        return block_layout.to_block_major(packed, peer, len(block_ids))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

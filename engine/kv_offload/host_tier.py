"""The second KV tier kvcache's block pool hands evicted prefix blocks to
(kvcache/second_tier.py): each block's KV, every layer's K and V (the drafter's
layers too), packed into one flat byte buffer in host memory, least recently used
first out; past --kv-offload-bytes a block moves to disk (disk_blocks.py) when
--kv-offload-dir is set, else it is lost.

The scheduler's calls (save, find, load) only queue; the runner's apply() makes
the copies, in the order queued, before the step's forward pass: a block saved and
then reused by another load in the same plan is copied out before it is filled
again. This object alone holds the tier's state; both callers are the engine
loop's thread. On CUDA the copies wait for the device (a later change can overlap
them on a side stream: bench/gpu_session.sh)."""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvserve.engine.kv_offload.disk_blocks import DiskBlocks

log = logging.getLogger("kvserve.kv_offload")

_SAVE, _LOAD = 0, 1


@dataclass
class TierStats:
    saved: int = 0  # blocks copied out of the KV cache
    loaded: int = 0  # blocks copied back into it
    from_disk: int = 0  # blocks read back from disk (and found sound)
    spilled: int = 0  # blocks moved from host memory to disk
    dropped: int = 0  # blocks lost past both capacities
    received: int = 0  # blocks another instance's prefill sent (engine/kv_transfer/)


class _Entry:
    __slots__ = ("data",)

    def __init__(self, data: torch.Tensor | None = None):
        self.data = data  # [block bytes] uint8 on the host; None until the save is made


def layout_key(model_key: str, block_size: int, caches: list[tuple]) -> str:
    """A fingerprint of what one block's bytes mean: a disk block of another model,
    block size, dtype or shape is never read."""
    parts = [model_key, str(block_size)]
    for k, v in caches:
        parts += [str(tuple(k.shape[1:])), str(k.dtype), str(v is k)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def cache_tensors(caches: list[tuple]) -> list[torch.Tensor]:
    """Each layer's cache tensors, K then V (latent attention's one tensor once): the
    order a block's bytes are packed in."""
    return [t for k, v in caches for t in ((k,) if v is k else (k, v))]


def block_bytes(caches: list[tuple]) -> int:
    """One block's KV in bytes, every cache tensor's slice."""
    return sum(t[0].numel() * t.element_size() for t in cache_tensors(caches))


class HostKVTier:
    def __init__(self, caches: list[tuple], capacity_bytes: int,
                 disk: DiskBlocks | None = None, keep_evicted: bool = True):
        # keep_evicted False: a tier only for blocks received from a prefill
        # instance (a decode instance without --kv-offload-bytes).
        self._tensors = cache_tensors(caches)
        self._sizes = [t[0].numel() * t.element_size() for t in self._tensors]
        self.block_bytes = sum(self._sizes)
        self.capacity_blocks = capacity_bytes // self.block_bytes
        if self.capacity_blocks < 1:
            raise ValueError(f"--kv-offload-bytes {capacity_bytes} holds no block of "
                             f"{self.block_bytes} bytes")
        self.disk = disk
        self.stats = TierStats()
        self._host: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self._ops: list[tuple[int, int, _Entry]] = []
        self._pin = self._tensors[0].device.type == "cuda"
        self.keep_evicted = keep_evicted

    def __len__(self) -> int:
        return len(self._host)

    # -- the scheduler's side (kvcache.second_tier.SecondTier) -------------------
    def save(self, block_id: int, block_hash: bytes) -> None:
        if not self.keep_evicted:
            return
        held = self._host.get(block_hash)
        if held is not None:
            self._host.move_to_end(block_hash)
            return
        if self.disk is not None and block_hash in self.disk:
            return
        entry = self._host[block_hash] = _Entry()
        self._ops.append((_SAVE, block_id, entry))

    def find(self, block_hash: bytes) -> bool:
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            return True
        if self.disk is None:
            return False
        data = self.disk.read(block_hash, self.block_bytes)
        if data is None:
            return False
        self.stats.from_disk += 1
        self._host[block_hash] = _Entry(torch.frombuffer(data, dtype=torch.uint8))
        return True

    def load(self, block_hash: bytes, block_id: int) -> None:
        self._ops.append((_LOAD, block_id, self._host[block_hash]))

    def clear(self) -> None:
        self._host.clear()  # queued copies keep their entries until made
        if self.disk is not None:
            self.disk.clear()

    # -- the KV transfer's side (the engine loop's thread too) ------------------
    def receive(self, block_hash: bytes, data: torch.Tensor) -> None:
        """A block's KV another instance computed (its bytes in this tier's layout:
        block_layout.py checks), most recently used: the request it came for is
        added next, and its prefix lookup finds it here."""
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            return
        self._host[block_hash] = _Entry(data)
        self.stats.received += 1
        self._trim()

    # -- the runner's side ----------------------------------------------------------
    def apply(self) -> None:
        """Makes the queued copies, in order, then keeps host memory within its
        capacity. Called before every step's forward pass."""
        if not self._ops:
            return
        ops, self._ops = self._ops, []
        for op, block_id, entry in ops:
            if op == _SAVE:
                entry.data = self._gather(block_id)
                self.stats.saved += 1
            else:
                self._scatter(block_id, entry.data)
                self.stats.loaded += 1
        self._trim()

    def _gather(self, block_id: int) -> torch.Tensor:
        out = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self._pin)
        at = 0
        for t, n in zip(self._tensors, self._sizes):
            out[at:at + n].copy_(t[block_id].reshape(-1).view(torch.uint8))
            at += n
        return out

    def _scatter(self, block_id: int, data: torch.Tensor) -> None:
        at = 0
        for t, n in zip(self._tensors, self._sizes):
            t[block_id].view(-1).view(torch.uint8).copy_(data[at:at + n])
            at += n

    def _trim(self) -> None:
        while len(self._host) > self.capacity_blocks:
            block_hash, entry = self._host.popitem(last=False)
            if self.disk is not None and entry.data is not None:
                self.disk.write(block_hash, memoryview(entry.data.numpy()))
                self.stats.spilled += 1
            else:
                self.stats.dropped += 1

"""How rank 0 hands each step to the other tensor-parallel ranks: the step's host
metadata (positions, cache slots, query starts, context lengths, block tables, the
logit rows, the copy-on-write copies) written once into a shared-memory segment
every rank maps, then one broadcast of a small header (the sizes, and the go
signal). No pickling, and nothing sent per rank. The input ids and the logit rows
go in the segment on CPU; on CUDA they are on rank 0's device (async scheduling
feeds pending tokens there; reading them back would wait for the device), so they
follow in one device broadcast.

A rank reads the segment before its first collective of the step, and rank 0 writes
the next step only after this one's last collective: no step overwrites one still
being read. A payload larger than the segment moves to a new, larger one (the
header names its generation and its random name).

Each segment is a file in /dev/shm, which every local user may write to: rank 0
creates it under a random name (126 bits from `secrets`, sent in the header) with
O_CREAT|O_EXCL|O_NOFOLLOW and mode 0600, so no other user can guess the name to
plant a file or a symlink there first (creation fails instead of using it), nor
read or write the steps. The other ranks (the same user) open it with O_NOFOLLOW
and map it only if it is a regular file of theirs that no one else may open.
Rank 0 unlinks a segment when a larger one replaces it, and at close.
multiprocessing.shared_memory would give O_EXCL and 0600 too, but before Python
3.13 attaching registers the segment with the attaching process's resource
tracker, which unlinks it when that rank exits.

With ranks on several hosts (`networked`) there is no segment to share: the same
payload follows the header in one broadcast over the CPU group, into a buffer of
each rank's own."""
from __future__ import annotations

import mmap
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.engine.kernels.attention.step_metadata import HostStep
from kvserve.engine.ranks import step_codec

STOP, FORWARD = 0, 1
# op, generation, name (2 words), capacity, L (logit rows), then the step's sizes
# (step_codec.META_WORDS)
_HEADER = 6 + step_codec.META_WORDS
_INITIAL_CAPACITY = 1 << 18  # int64s: 2 MiB
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass
class Step:
    """One step as a rank other than 0 receives it."""
    host: HostStep
    input_ids: torch.Tensor  # [T] on the device
    logit_rows: torch.Tensor  # [L] int64 on the device
    copies: list[tuple[int, int, int]]  # (src block, dst block, tokens)


def _segment_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _new_token() -> list[int]:
    """A segment's unguessable part: two random 63-bit words (they travel in the
    int64 header)."""
    return [secrets.randbits(63), secrets.randbits(63)]


def _create(path: str, nbytes: int) -> mmap.mmap:
    """Rank 0's new segment. O_EXCL: a file or symlink already at `path` (planted
    by someone who guessed the name) makes this fail, never used or followed."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask took away (it cannot add)
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _attach(path: str, nbytes: int) -> mmap.mmap:
    """Another rank's view of rank 0's segment, refused unless it is a regular file
    of this user's that no one else may open."""
    fd = os.open(path, os.O_RDWR | _NOFOLLOW)
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & 0o077 or st.st_size < nbytes):
            raise RuntimeError(f"step segment {path} is not rank 0's (owner uid "
                               f"{st.st_uid}, mode {stat.filemode(st.st_mode)}, "
                               f"{st.st_size} bytes): refusing it")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class StepChannel:
    """name: the segments' name prefix, the same on every rank (rank 0 adds each
    segment's random part); cpu_group: a gloo group of all ranks (the default group
    on CPU) for the header."""

    def __init__(self, name: str, rank: int, device: torch.device, block_size: int,
                 cpu_group=None, networked: bool = False):
        self.stem = os.path.join(_segment_dir(), name)
        self.rank, self.device, self.block_size = rank, device, block_size
        self.cpu_group = cpu_group
        self.networked = networked  # ranks on other hosts: the payload is broadcast
        self.generation, self.capacity = -1, 0
        self.token = [0, 0]  # the current segment's random name part
        self.path: str | None = None  # rank 0: the current segment, until unlinked
        self.buffer: torch.Tensor | None = None
        self.pending_copies: list[tuple[int, int, int]] = []  # sent with the next step

    def _segment_path(self, generation: int, token: list[int]) -> str:
        return f"{self.stem}-{generation}-{token[0]:016x}{token[1]:016x}"

    def _map(self, generation: int, token: list[int], capacity: int) -> None:
        if self.networked:
            self.buffer = torch.empty(capacity, dtype=torch.int64)
            self.generation, self.token, self.capacity = generation, token, capacity
            return
        path = self._segment_path(generation, token)
        if self.rank == 0:
            mapped = _create(path, capacity * 8)
        else:
            mapped = _attach(path, capacity * 8)
        # The tensor keeps the mapping alive; the one it replaces is unmapped once
        # nothing reads it.
        self.buffer = torch.frombuffer(mapped, dtype=torch.int64, count=capacity)
        if self.rank == 0:
            self._unlink()  # the old one stays mapped where it is still read
            self.path = path
        self.generation, self.token, self.capacity = generation, token, capacity

    def _unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def close(self) -> None:
        if self.rank == 0:
            self._unlink()
            self.generation = -1

    # -- rank 0 --------------------------------------------------------------
    def send(self, host: HostStep, input_ids: torch.Tensor, logit_rows: torch.Tensor) -> None:
        """Before rank 0's forward pass of the step: every rank runs the same one."""
        on_cpu = self.device.type == "cpu"
        meta, step_parts = step_codec.encode(host, self.pending_copies)
        self.pending_copies = []
        on_device = [input_ids.reshape(-1), logit_rows.reshape(-1)]
        parts = (on_device if on_cpu else []) + step_parts
        size = sum(p.numel() for p in parts)
        if size > self.capacity:
            self._map(self.generation + 1, _new_token(),
                      max(size, 2 * self.capacity, _INITIAL_CAPACITY))
        torch.cat(parts, out=self.buffer[:size])
        self._header([FORWARD, self.generation, *self.token, self.capacity,
                      len(logit_rows), *meta])
        if self.networked:
            dist.broadcast(self.buffer[:size], src=0, group=self.cpu_group)
        if not on_cpu:
            dist.broadcast(torch.cat(on_device), src=0)

    def stop(self) -> None:
        self._header([STOP] + [0] * (_HEADER - 1))

    def _header(self, values: list[int]) -> list[int]:
        header = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.cpu_group)
        return header.tolist()

    # -- the other ranks -----------------------------------------------------------
    def receive(self) -> Step | None:
        """The next step; None when rank 0 stops."""
        op, gen, token_a, token_b, capacity, num_rows, *meta = self._header([0] * _HEADER)
        if op == STOP:
            return None
        if gen != self.generation:
            self._map(gen, [token_a, token_b], capacity)
        on_cpu = self.device.type == "cpu"
        t = meta[0]
        lengths = ([t, num_rows] if on_cpu else []) + step_codec.sizes(meta)
        if self.networked:
            dist.broadcast(self.buffer[:sum(lengths)], src=0, group=self.cpu_group)
        parts = self.buffer[:sum(lengths)].clone().split(lengths)
        if on_cpu:
            (input_ids, rows), parts = parts[:2], parts[2:]
        else:
            on_device = torch.empty(t + num_rows, dtype=torch.long, device=self.device)
            dist.broadcast(on_device, src=0)
            input_ids, rows = on_device.split([t, num_rows])
        host, copies = step_codec.decode(meta, list(parts), self.block_size)
        return Step(host, input_ids, rows, copies)

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
header names its generation)."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.attention.step_metadata import HostStep

STOP, FORWARD = 0, 1
_HEADER = 11  # op, generation, capacity, T, R, W, L, C, max_query_len, max_seq_len, decodes
_INITIAL_CAPACITY = 1 << 18  # int64s: 2 MiB


@dataclass
class Step:
    """One step as a rank other than 0 receives it."""
    host: HostStep
    input_ids: torch.Tensor  # [T] on the device
    logit_rows: torch.Tensor  # [L] int64 on the device
    copies: list[tuple[int, int, int]]  # (src block, dst block, tokens)


def _segment_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class StepChannel:
    """name: the segment's path stem, the same on every rank; cpu_group: a gloo group
    of all ranks (the default group on CPU) for the header."""

    def __init__(self, name: str, rank: int, device: torch.device, block_size: int,
                 cpu_group=None):
        self.stem = os.path.join(_segment_dir(), name)
        self.rank, self.device, self.block_size = rank, device, block_size
        self.cpu_group = cpu_group
        self.generation, self.capacity = -1, 0
        self.buffer: torch.Tensor | None = None
        self.pending_copies: list[tuple[int, int, int]] = []  # sent with the next step

    def _map(self, generation: int, capacity: int) -> None:
        path = f"{self.stem}-{generation}"
        if self.rank == 0:
            with open(path, "wb") as f:
                f.truncate(capacity * 8)
        self.buffer = torch.from_file(path, shared=True, size=capacity, dtype=torch.int64)
        if self.rank == 0 and self.generation >= 0:
            os.unlink(f"{self.stem}-{self.generation}")  # mapped where still read
        self.generation, self.capacity = generation, capacity

    def close(self) -> None:
        if self.rank == 0 and self.generation >= 0:
            try:
                os.unlink(f"{self.stem}-{self.generation}")
            except FileNotFoundError:
                pass
            self.generation = -1

    # -- rank 0 --------------------------------------------------------------
    def send(self, host: HostStep, input_ids: torch.Tensor, logit_rows: torch.Tensor) -> None:
        """Before rank 0's forward pass of the step: every rank runs the same one."""
        on_cpu = self.device.type == "cpu"
        copies = torch.tensor(self.pending_copies, dtype=torch.int64).reshape(-1)
        self.pending_copies = []
        on_device = [input_ids.reshape(-1), logit_rows.reshape(-1)]
        parts = on_device if on_cpu else []
        parts += [host.positions, host.slot_mapping, host.query_start_loc.long(),
                  host.seq_lens.long(), host.block_tables.long().reshape(-1), copies]
        size = sum(p.numel() for p in parts)
        if size > self.capacity:
            self._map(self.generation + 1, max(size, 2 * self.capacity, _INITIAL_CAPACITY))
        torch.cat(parts, out=self.buffer[:size])
        r, w = host.block_tables.shape
        self._header([FORWARD, self.generation, self.capacity, len(host.positions), r, w,
                      len(logit_rows), len(copies) // 3, host.max_query_len,
                      host.max_seq_len, host.num_decodes])
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
        (op, gen, capacity, t, r, w, num_rows, num_copies, max_q, max_seq,
         decodes) = self._header([0] * _HEADER)
        if op == STOP:
            return None
        if gen != self.generation:
            self._map(gen, capacity)
        on_cpu = self.device.type == "cpu"
        sizes = [t, num_rows] if on_cpu else []
        sizes += [t, t, r + 1, r, r * w, 3 * num_copies]
        parts = self.buffer[:sum(sizes)].clone().split(sizes)
        if on_cpu:
            (input_ids, rows), parts = parts[:2], parts[2:]
        else:
            on_device = torch.empty(t + num_rows, dtype=torch.long, device=self.device)
            dist.broadcast(on_device, src=0)
            input_ids, rows = on_device.split([t, num_rows])
        positions, slots, qsl, seq_lens, tables, copies = parts
        host = HostStep(positions, slots, qsl.int(), seq_lens.int(), tables.int().view(r, w),
                        max_q, max_seq, decodes, self.block_size)
        return Step(host, input_ids, rows, [tuple(c) for c in copies.view(-1, 3).tolist()])

"""Builds a step's flat-batch tensors on the host, vectorised (no per-token Python
loop), and moves them to the device with one copy per dtype."""
from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvserve.engine.kernels.attention.context import AttentionMetadata


@dataclass
class HostStep:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_tables: torch.Tensor  # [R, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    block_size: int
    # A hybrid model's sliding-window layer groups' (slot_mapping, block_tables),
    # group 1 first (engine/models/kv_caches.py LayerGroups); () for other models.
    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def to_device(self, device: torch.device, extra: Sequence[torch.Tensor] = ()
                  ) -> tuple[torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
        """(positions, the common attention metadata, `extra`) on `device`, moved
        together with one copy per dtype."""
        num_extra = len(extra)
        positions, slots, qsl, seq_lens, tables, *rest = upload(
            [self.positions, self.slot_mapping, self.query_start_loc, self.seq_lens,
             self.block_tables, *extra, *(t for group in self.groups for t in group)],
            device)
        extra, flat_groups = rest[:num_extra], rest[num_extra:]
        num_reqs = len(self.seq_lens)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
            query_start_loc_cpu=self.query_start_loc, seq_lens_cpu=self.seq_lens,
            max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
            num_decodes=self.num_decodes, num_prefills=num_reqs - self.num_decodes,
            num_tokens=len(self.positions), block_size=self.block_size)
        if flat_groups:
            meta.groups = tuple(replace(meta, slot_mapping=s, block_tables=t)
                                for s, t in zip(flat_groups[::2], flat_groups[1::2]))
        return positions, meta, extra


def build_host_step(starts: list[int], lens: list[int],
                    tables: list[list[int]] | np.ndarray, block_size: int,
                    group_tables: Sequence[list[list[int]] | np.ndarray] = ()) -> HostStep:
    """starts[i]: tokens request i already has in the cache; lens[i]: tokens it
    computes now; tables: its block table, as lists or already padded ([R, width],
    see engine/runner/block_table_rows.py); group_tables: a hybrid model's sliding
    layer groups' tables, alike. Requests that compute one token must come first
    (they are the decodes). Numpy, not torch: a few small ops, each ~1 µs instead of
    several, on the host's critical path every step."""
    num_decodes = lens.count(1)
    if lens[:num_decodes] != [1] * num_decodes:
        raise ValueError("requests computing one token (decodes) must come first")
    starts_a = np.asarray(starts, dtype=np.int64)
    lens_a = np.asarray(lens, dtype=np.int64)
    query_start = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens_a, out=query_start[1:])
    if num_decodes == len(lens):  # decodes only: one token each, no expansion
        req_index, positions = np.arange(len(lens)), starts_a
    else:
        req_index = np.repeat(np.arange(len(lens)), lens_a)
        positions = starts_a[req_index] + (np.arange(query_start[-1])
                                           - query_start[req_index])
    block_index, offset = positions // block_size, positions % block_size

    def slots_and_table(tables) -> tuple[torch.Tensor, torch.Tensor]:
        table = tables if isinstance(tables, np.ndarray) else _pad(tables)
        idx = np.minimum(block_index, table.shape[1] - 1)
        return (torch.from_numpy(table[req_index, idx] * block_size + offset),
                torch.from_numpy(table.astype(np.int32)))

    slots, table = slots_and_table(tables)
    seq_lens = starts_a + lens_a
    return HostStep(torch.from_numpy(positions), slots,
                    torch.from_numpy(query_start.astype(np.int32)),
                    torch.from_numpy(seq_lens.astype(np.int32)), table,
                    max(lens), int(seq_lens.max()), num_decodes, block_size,
                    tuple(slots_and_table(t) for t in group_tables))


def _pad(tables: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for row, t in zip(out, tables):
        row[:len(t)] = t
    return out


def context_slots(block_tables: torch.Tensor, positions: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """Cache slots of token positions. block_tables: [..., max_blocks]; positions:
    same leading dims, any last dim."""
    tables = block_tables.long()
    idx = (positions // block_size).clamp(max=tables.shape[-1] - 1)
    return tables.gather(-1, idx) * block_size + positions % block_size


ALIGN_BYTES = 16


def upload(tensors: list[torch.Tensor], device: torch.device,
           pack: bool | None = None) -> list[torch.Tensor]:
    """The tensors on `device`. On CUDA those of one dtype are packed into one pinned
    host buffer and copied with one non-blocking transfer (the caching host
    allocator keeps the buffer alive until the copy is done). Each one starts
    16-byte aligned in it: Triton compiles a kernel for each alignment of its
    pointers, and a piece's alignment would otherwise change with the lengths of
    those before it (a compile mid-serving each time, and no vector loads).
    pack: packed on the CPU too (bench/triton_aot_check.py lays steps out so)."""
    if not (device.type != "cpu" if pack is None else pack):
        return list(tensors)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        buf, starts = pack_aligned([tensors[i] for i in idx], pin=device.type == "cuda")
        moved = buf.to(device, non_blocking=True)
        for i, start in zip(idx, starts):
            out[i] = moved[start:start + tensors[i].numel()].view(tensors[i].shape)
    return out


def pack_aligned(tensors: list[torch.Tensor], pin: bool) -> tuple[torch.Tensor, list[int]]:
    """One flat buffer (pinned if `pin`) holding tensors of one dtype, each starting
    ALIGN_BYTES-aligned, and where each starts (elements)."""
    unit = max(1, ALIGN_BYTES // tensors[0].element_size())
    sizes = [t.numel() for t in tensors]
    starts = list(accumulate((-(-n // unit) * unit for n in sizes[:-1]), initial=0))
    buf = torch.empty(starts[-1] + sizes[-1], dtype=tensors[0].dtype, pin_memory=pin)
    for t, start, n in zip(tensors, starts, sizes):
        buf[start:start + n].copy_(t.reshape(-1))
    return buf, starts

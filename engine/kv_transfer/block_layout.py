"""Where a block's bytes lie in an instance's KV cache, and how a peer's blocks map
onto a packed copy here. A block is, for each cache tensor in the second tier's
order (every layer's K then V), one contiguous slice at base + block_id * stride; a
packed copy holds those slices back to back (HostKVTier's layout), so a block read
from a peer is a block the tier can load.

Both instances must agree on what the bytes mean: the fingerprint covers the block
size and each tensor's shape and dtype. The model and its weights the chained block
hashes already cover (their root is the model key, the salt and the adapter)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Region:
    base: int  # the address of block 0's slice
    stride: int  # bytes from one block's slice to the next
    nbytes: int  # one block's slice


def fingerprint(tensors: list[torch.Tensor], block_size: int) -> str:
    parts = [str(block_size)] + [f"{tuple(t.shape[1:])}/{t.dtype}" for t in tensors]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def regions(tensors: list[torch.Tensor]) -> list[Region]:
    out = []
    for t in tensors:
        if not t[0].is_contiguous():
            raise ValueError("KV transfer needs each block's slice of a cache tensor "
                             "contiguous")
        size = t.element_size()
        out.append(Region(t.data_ptr(), t.stride(0) * size, t[0].numel() * size))
    return out


def storages(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The distinct memory ranges the tensors live in (several layers may share
    one), to register with the transfer engine once each."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sorted(seen.items())


def runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first position, first block id, count) of each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for j, block_id in enumerate(block_ids):
        if out and out[-1][1] + out[-1][2] == block_id:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((j, block_id, 1))
    return out


def block_reads(peer: list[Region], block_ids: list[int], local_base: int
                ) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) that copy the peer's blocks into a
    tensor-major buffer at local_base (every block's slice of tensor 0, then of
    tensor 1, ...): a run of consecutive block ids is one range per tensor, where
    block-major packing would need one per block and tensor (a long prompt on a
    deep model: thousands, past what one batch of the transfer engine takes)."""
    n = len(block_ids)
    local, remote, lengths = [], [], []
    at = local_base
    for r in peer:
        contiguous = r.stride == r.nbytes  # the slices of consecutive blocks touch
        for j, first, count in (runs(block_ids) if contiguous
                                else [(j, b, 1) for j, b in enumerate(block_ids)]):
            local.append(at + j * r.nbytes)
            remote.append(r.base + first * r.stride)
            lengths.append(count * r.nbytes)
        at += n * r.nbytes
    return local, remote, lengths


def to_block_major(packed: torch.Tensor, peer: list[Region], n: int) -> torch.Tensor:
    """The tensor-major buffer block_reads filled, as n blocks packed back to back
    (each its tensors' slices in order: HostKVTier's layout)."""
    sizes = [r.nbytes for r in peer]
    out = torch.empty(n, sum(sizes), dtype=torch.uint8)
    at = col = 0
    for size in sizes:
        out[:, col:col + size].copy_(packed[at:at + n * size].view(n, size))
        at += n * size
        col += size
    return out.view(-1)

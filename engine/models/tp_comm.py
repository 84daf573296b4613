"""The tensor-parallel group of this process (one per process, as torch.distributed's
default group is): its rank and size, and the two collectives the model makes.
At size 1 (no group) both are the identity, so the model code calls them always."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from kvserve.engine.models.tp_shard import SINGLE, TPShard

_shard: TPShard = SINGLE


def init(shard: TPShard, port: int, device: torch.device, addr: str = "127.0.0.1",
         ranks_here: int | None = None) -> None:
    """Joins ranks on addr:port (rank 0 hosts the rendezvous): NCCL on CUDA, gloo on
    CPU. Blocks until every rank has joined. ranks_here: how many of them share this
    host (all by default)."""
    global _shard
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu":  # the ranks share the cores: more threads only contend
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))
                                  // (ranks_here or shard.size)))
    # A rank that dies is noticed by its peers' sockets, not by this timeout; it only
    # bounds a rank that hangs alive.
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}",
                            rank=shard.rank, world_size=shard.size,
                            timeout=timedelta(minutes=10),
                            device_id=device if device.type == "cuda" else None)
    _shard = shard


def destroy() -> None:
    global _shard
    if dist.is_initialized():
        dist.destroy_process_group()
    _shard = SINGLE


def shard() -> TPShard:
    return _shard


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the ranks, in place (row-parallel layers' partial sums)."""
    if _shard.size > 1:
        dist.all_reduce(x)
    return x


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rank 0 gets every rank's vocabulary columns side by side [rows, vocab_size];
    the other ranks get their own columns back (they sample nothing)."""
    if _shard.size == 1:
        return logits
    if _shard.rank != 0:
        dist.gather(logits.contiguous(), dst=0)
        return logits
    parts = [torch.empty_like(logits) for _ in range(_shard.size)]
    dist.gather(logits.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1)[:, :vocab_size]

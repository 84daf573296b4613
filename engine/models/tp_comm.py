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
# Under pipeline parallelism each stage's ranks are a group of their own (None: the
# default group is the tensor-parallel one), whose rank 0 (`_leader`, a global rank)
# gathers the logits.
_group = None
_leader = 0


def init(shard: TPShard, port: int, device: torch.device, addr: str = "127.0.0.1",
         ranks_here: int | None = None) -> None:
    """Joins the tensor-parallel ranks on addr:port (init_world), this one `shard`."""
    global _shard
    init_world(shard.rank, shard.size, port, device, addr, ranks_here)
    _shard = shard


def init_world(rank: int, size: int, port: int, device: torch.device,
               addr: str = "127.0.0.1", ranks_here: int | None = None) -> None:
    """Joins `size` processes on addr:port (rank 0 hosts the rendezvous): NCCL on
    CUDA, gloo on CPU. Blocks until every rank has joined. ranks_here: how many of
    them share this host (all by default). Pipeline stages join this way alone:
    their tensor-parallel shard stays whole."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cpu":  # the ranks share the cores: more threads only contend
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // (ranks_here or size)))
    # A rank that dies is noticed by its peers' sockets, not by this timeout; it only
    # bounds a rank that hangs alive.
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}",
                            rank=rank, world_size=size, timeout=timedelta(minutes=10),
                            device_id=device if device.type == "cuda" else None)


def join_stage(rank: int, stages: list[list[int]]) -> None:
    """Pipeline stages of several ranks each (stages[s]: stage s's global ranks, in
    tensor-parallel order): every process makes every stage's group, in the same
    order, and joins its own as its tensor-parallel group."""
    global _shard, _group, _leader
    groups = [dist.new_group(ranks) for ranks in stages]
    for ranks, group in zip(stages, groups):
        if rank in ranks:
            _shard, _group, _leader = TPShard(ranks.index(rank), len(ranks)), group, ranks[0]


def destroy() -> None:
    global _shard, _group, _leader
    if dist.is_initialized():
        dist.destroy_process_group()
    _shard, _group, _leader = SINGLE, None, 0


def shard() -> TPShard:
    return _shard


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the ranks, in place (row-parallel layers' partial sums)."""
    if _shard.size > 1:
        dist.all_reduce(x, group=_group)
    return x


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rank 0 gets every rank's vocabulary columns side by side [rows, vocab_size];
    the other ranks get their own columns back (they sample nothing)."""
    if _shard.size == 1:
        return logits
    if _shard.rank != 0:
        dist.gather(logits.contiguous(), dst=_leader, group=_group)
        return logits
    parts = [torch.empty_like(logits) for _ in range(_shard.size)]
    dist.gather(logits.contiguous(), parts, dst=_leader, group=_group)
    return torch.cat(parts, dim=-1)[:, :vocab_size]

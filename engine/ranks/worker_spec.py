"""What a worker rank is told when it starts (engine/ranks/launch.py writes it,
worker.py reads it): pickled into a file only it reads."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.config.engine_config import EngineConfig


@dataclass
class WorkerSpec:
    config: EngineConfig
    rank: int
    size: int
    port: int  # rank 0's rendezvous
    channel: str  # the step channel's segment name
    device: str
    dtype: torch.dtype
    max_model_len: int
    parent_pid: int
    addr: str = "127.0.0.1"  # rank 0's rendezvous host
    ranks_here: int | None = None  # ranks on this host (they share its cores)
    networked: bool = False  # ranks on several hosts: steps come by broadcast

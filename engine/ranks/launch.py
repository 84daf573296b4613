"""Starting tensor-parallel worker ranks on this host (engine/ranks/worker.py), for
rank 0's group on node 0 and for a --headless node alike, and where their
rendezvous is."""
from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile

import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.ranks.worker_spec import WorkerSpec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(config: EngineConfig) -> tuple[str, int]:
    """(address, port) of node 0's rendezvous: the flags, else torchrun's variables,
    else (one node only) a free port on loopback."""
    addr = config.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = config.master_port or int(os.environ.get("MASTER_PORT") or 0)
    if not port:
        if config.nnodes > 1:
            raise ValueError(f"--nnodes {config.nnodes} needs --master-port (or "
                             "$MASTER_PORT), the same on every node")
        port = _free_port()
    return addr, port


def world_size(config: EngineConfig) -> int:
    """Every rank: tensor-parallel-size in each of pipeline-parallel-size stages."""
    return config.tensor_parallel_size * config.pipeline_parallel_size


def ranks_per_node(config: EngineConfig) -> int:
    return world_size(config) // config.nnodes


def spawn_workers(config: EngineConfig, ranks: range, addr: str, port: int, channel: str,
                  device: torch.device, dtype: torch.dtype, max_model_len: int
                  ) -> list[subprocess.Popen]:
    """One worker process per rank of `ranks` (of world_size(config); per_node of
    them on each host), each told its rendezvous,
    its device (cuda:<its index on this host>) and to exit with this process. Plain
    subprocesses: the engine process is itself a daemonic multiprocessing child,
    which may not have any."""
    per_node = ranks_per_node(config)
    procs = []
    for rank in ranks:
        spec = WorkerSpec(config, rank, world_size(config), port, channel,
                          f"cuda:{rank % per_node}" if device.type == "cuda" else "cpu",
                          dtype, max_model_len, os.getpid(), addr, per_node,
                          networked=config.nnodes > 1)
        with tempfile.NamedTemporaryFile("wb", suffix=".tp-spec", delete=False) as f:
            pickle.dump(spec, f)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvserve.engine.ranks.worker", f.name]))
    return procs

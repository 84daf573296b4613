"""Tensor parallelism from rank 0's side: rank 0 is the engine's own process (its
scheduler, sampler and runner); it starts one worker process per other rank
(engine/ranks/worker.py), joins them in one torch.distributed group (NCCL on
CUDA, gloo on CPU), and watches them: a rank that dies takes the engine down,
as a dead engine loop does (health 503, the server exits non-zero).

With --nnodes N the ranks are spread over N hosts, tensor-parallel-size / N each:
rank 0 starts only its own host's (launch.py), and each other host's are started
by `kvserve serve --headless` there (headless.py); they all meet at node 0's
rendezvous (--master-addr, --master-port).

A rank that dies on another host is not watched from here: the group's next
collective fails on its closed socket, and the engine dies of it."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.models import tp_comm as comm
from kvserve.engine.models.tp_shard import TPShard
from kvserve.engine.ranks.launch import ranks_per_node, rendezvous, spawn_workers
from kvserve.engine.ranks.step_channel import StepChannel
from kvserve.engine.ranks.watch import WorkerWatch
from kvserve.modelstore.errors import ModelLoadError

log = logging.getLogger("kvserve.tensor_parallel")


def check_options(config: EngineConfig, device: torch.device) -> None:
    """Raises ModelLoadError for what does not run under tensor parallelism yet."""
    refuse = {
        "LoRA adapters": config.lora is not None,
        "weight quantization": config.quantization not in ("auto", "none"),
        "an fp8 KV cache": config.kv_cache_dtype != "auto",
        "model-drafted speculation (ngram works)": (config.speculative is not None
                                                    and config.speculative.method != "ngram"),
        # The memory profile's step would need every rank: say the cache's size.
        "a KV cache sized by profiling (give --num-kv-blocks or --kv-cache-memory)": (
            device.type == "cuda" and not config.num_kv_blocks
            and config.kv_cache_memory is None),
    }
    refuse_options(f"--tensor-parallel-size {config.tensor_parallel_size}", refuse)


def refuse_options(flag: str, refuse: dict[str, bool]) -> None:
    """Raises ModelLoadError naming every option of `refuse` that is on."""
    refused = [what for what, on in refuse.items() if on]
    if refused:
        raise ModelLoadError(f"{flag} does not work with {', '.join(refused)} yet")


class TensorParallelGroup:
    """Started before rank 0 loads its weights, so every rank loads at once."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int):
        size = config.tensor_parallel_size
        TPShard(0, size).check(model_config)
        check_options(config, device)
        if config.node_rank:
            raise ModelLoadError(f"--node-rank {config.node_rank} serves no engine: run "
                                 "it with --headless")
        addr, port = rendezvous(config)
        name = f"kvserve-tp-{os.getpid()}-{port}"
        # This host's other ranks; the other nodes' are their --headless servers'.
        self._watch = WorkerWatch(spawn_workers(config, range(1, ranks_per_node(config)),
                                                addr, port, name, device, dtype,
                                                max_model_len), "tensor-parallel rank")
        comm.init(TPShard(0, size), port, device, addr, ranks_per_node(config))
        self.cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
        self.channel = StepChannel(name, 0, device, config.block_size, self.cpu_group,
                                   networked=config.nnodes > 1)
        log.info("tensor parallel: %d ranks on %s (%s)%s", size, device.type,
                 "nccl" if device.type == "cuda" else "gloo",
                 f", {config.nnodes} nodes, rendezvous {addr}:{port}"
                 if config.nnodes > 1 else "")

    def share_num_blocks(self, num_blocks: int) -> None:
        """Every rank allocates the KV cache rank 0 sized (its own heads of it)."""
        dist.broadcast(torch.tensor([num_blocks], dtype=torch.int64), src=0,
                       group=self.cpu_group)

    def on_death(self, callback: Callable[[str], None]) -> None:
        """callback(why) runs on the watcher's thread when a worker rank dies."""
        self._watch.on_death(callback)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the workers (killed if they do not stop in `timeout`) and leaves
        the group."""
        self._watch.stopping = True
        try:
            self.channel.stop()
        except RuntimeError:  # a rank is gone: the broadcast cannot complete
            pass
        self._watch.stop(timeout)
        self.channel.close()
        comm.destroy()


def start_group(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                dtype: torch.dtype, max_model_len: int) -> TensorParallelGroup | None:
    """The group of --tensor-parallel-size ranks; None at one rank."""
    if config.tensor_parallel_size == 1 or config.pipeline_parallel_size > 1:
        return None  # (pipeline stages start their own ranks: engine/ranks/pipeline.py)
    return TensorParallelGroup(config, model_config, device, dtype, max_model_len)

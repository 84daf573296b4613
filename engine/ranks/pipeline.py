"""Pipeline parallelism from the engine's side (--pipeline-parallel-size P): the
model's layers in P consecutive stages, one process each. The engine's own process
is rank 0 and the LAST stage (its layers, the final norm, the LM head and the
sampler, which read the scheduler's requests); the other stages are worker
processes (engine/ranks/stage_worker.py) holding only their layers' weights and KV
cache. With --tensor-parallel-size T each stage is T ranks (stage_ranks.py), its
layers split over them and all-reduced in the stage's own group; each rank hands
the step on to the same rank of the next stage. Each step goes engine -> stage 0 -> ... -> stage P-2 -> engine
(stage_link.py), and the engine launches up to P steps before it waits for the
oldest (Engine.step), so while it runs its layers of step k the first stage runs
step k+1: the scheduler keeps a request out of a step while its token is still on
the way (SchedulerConfig.wait_for_sampled), and spreads the running requests over
the steps in flight.

A stage that dies takes the engine down (health 503, the server exits non-zero), as
a dead tensor-parallel rank does."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.kernels.attention.step_metadata import HostStep
from kvserve.engine.models import tp_comm as comm
from kvserve.engine.models.kv_caches import layer_groups
from kvserve.engine.models.pipeline_stage import PipelineStage, stage_of
from kvserve.engine.models.tp_shard import TPShard
from kvserve.engine.ranks.group import check_options as check_tp_options, refuse_options
from kvserve.engine.ranks.launch import ranks_per_node, rendezvous, spawn_workers
from kvserve.engine.ranks.stage_link import StageLink
from kvserve.engine.ranks.stage_ranks import StageRanks
from kvserve.engine.ranks.watch import WorkerWatch
from kvserve.engine.weights.loader import resolve_load_format
from kvserve.modelstore.errors import ModelLoadError

log = logging.getLogger("kvserve.pipeline")


def check_options(config: EngineConfig, model_config: ModelConfig,
                  device: torch.device) -> None:
    """Raises ModelLoadError for what does not run in pipeline stages yet."""
    refuse = {
        # (Each stage would draw its own; tensor-parallel ranks read safetensors too.)
        "random weights or a GGUF file (give a safetensors checkpoint)":
            resolve_load_format(config.model, config.load_format) != "safetensors",
        "LoRA adapters": config.lora is not None,
        "weight quantization": config.quantization not in ("auto", "none"),
        "an fp8 KV cache": config.kv_cache_dtype != "auto",
        "speculative decoding": config.speculative is not None,
        "async scheduling (the steps in flight already overlap)": config.async_scheduling,
        "a second KV tier": bool(config.kv_offload_bytes or config.kv_offload_dir),
        "sliding-window layer groups": layer_groups(model_config, config) is not None,
        "a KV cache sized by profiling (give --num-kv-blocks or --kv-cache-memory)": (
            device.type == "cuda" and not config.num_kv_blocks
            and config.kv_cache_memory is None),
    }
    refuse_options(f"--pipeline-parallel-size {config.pipeline_parallel_size}", refuse)


@contextlib.contextmanager
def _stage_lost():
    """gloo's error for a peer's closed socket, said as what it means here (the
    engine dies of it: its error is the server's last word)."""
    try:
        yield
    except RuntimeError as exc:
        raise RuntimeError(f"a pipeline stage is gone: {exc}") from exc


class PipelineGroup:
    """Started before the engine loads its stage, so every stage loads at once."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int):
        size, tp = config.pipeline_parallel_size, config.tensor_parallel_size
        check_options(config, model_config, device)
        if tp > 1:  # every stage split over tp ranks, as --tensor-parallel-size alone
            TPShard(0, tp).check(model_config)
            check_tp_options(config, device)
        self.ranks = StageRanks(tp, size)
        self.stage: PipelineStage = stage_of(model_config, size - 1, size)
        addr, port = rendezvous(config)
        # This host's other ranks; the other nodes' are their --headless servers'.
        here = ranks_per_node(config)
        self._watch = WorkerWatch(spawn_workers(config, range(1, here), addr, port, "",
                                                device, dtype, max_model_len),
                                  "pipeline rank")
        comm.init_world(0, self.ranks.world, port, device, addr, here)
        if tp > 1:
            comm.join_stage(0, self.ranks.stages())
        self.cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
        self.link = StageLink(device, config.block_size, model_config.hidden_size, dtype,
                              self.cpu_group)
        self.pending_copies: list[tuple[int, int, int]] = []  # sent with the next step
        self.steps_in_flight = size  # at most, launched before the oldest is waited for
        log.info("pipeline parallel: %d stages of %d rank%s on %s (%s), layers %s", size,
                 tp, "s" if tp > 1 else "", device.type,
                 "nccl" if device.type == "cuda" else "gloo",
                 ", ".join(f"{a}-{b - 1}" for a, b in (
                     (s.start, s.end) for s in (stage_of(model_config, i, size)
                                                for i in range(size)))))

    def share_num_blocks(self, num_blocks: int) -> None:
        """Every stage allocates the KV cache the engine sized (its own layers')."""
        dist.broadcast(torch.tensor([num_blocks], dtype=torch.int64), src=0,
                       group=self.cpu_group)

    def send(self, host: HostStep, input_ids: torch.Tensor, logit_rows: torch.Tensor) -> None:
        """A step into the first stage (each of its ranks); its copy-on-write copies
        go with it."""
        copies, self.pending_copies = self.pending_copies, []
        with _stage_lost():
            for first in self.ranks.stages()[0]:
                self.link.send_step(first, host, copies, input_ids, logit_rows)

    def receive(self, num_tokens: int) -> torch.Tensor:
        """The oldest step's hidden states from the stage before the last."""
        with _stage_lost():
            return self.link.receive_hidden(self.ranks.previous(0), num_tokens)

    def on_death(self, callback: Callable[[str], None]) -> None:
        self._watch.on_death(callback)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the stages (killed if they do not stop in `timeout`)."""
        self._watch.stopping = True
        try:
            for first in self.ranks.stages()[0]:
                self.link.send_stop(first)
            self.link.drain()
        except RuntimeError:  # a stage is gone
            pass
        self._watch.stop(timeout)
        comm.destroy()


def start_pipeline(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                   dtype: torch.dtype, max_model_len: int) -> PipelineGroup | None:
    """The group of --pipeline-parallel-size stages; None at one stage."""
    if config.pipeline_parallel_size == 1:
        return None
    if config.node_rank:
        raise ModelLoadError(f"--node-rank {config.node_rank} serves no engine: run "
                             "it with --headless")
    return PipelineGroup(config, model_config, device, dtype, max_model_len)

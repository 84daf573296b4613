"""A pipeline rank other than the engine's (engine/ranks/pipeline.py; where each
runs: stage_ranks.py). It loads its stage's layers' weights (its tensor-parallel
part of them; the embedding on the first stage), allocates their KV cache, and runs
every step that reaches it from the stage before (the engine, for the first) and
hands it to the next, until the stop comes down the chain. It samples nothing: on
the last stage (the engine's tensor-parallel peers) its logit columns are gathered
on the engine."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.ranks.worker_spec import WorkerSpec

log = logging.getLogger("kvserve.stage_worker")


def serve_stage(spec: WorkerSpec) -> None:
    from kvserve.engine.kernels.attention import make_backend
    from kvserve.engine.models import tp_comm as comm
    from kvserve.engine.models.kv_caches import KVCacheFormat, attach_kv_caches
    from kvserve.engine.models.pipeline_stage import stage_of
    from kvserve.engine.ranks.stage_link import StageLink
    from kvserve.engine.ranks.stage_ranks import StageRanks
    from kvserve.engine.weights.cpu_packing import pack_model
    from kvserve.engine.weights.loader import load_model

    config, device = spec.config, torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ranks = StageRanks(config.tensor_parallel_size, config.pipeline_parallel_size)
    comm.init_world(spec.rank, spec.size, spec.port, device, spec.addr, spec.ranks_here)
    if ranks.tp > 1:
        comm.join_stage(spec.rank, ranks.stages())
    cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
    model_config = ModelConfig.from_pretrained(config.model)
    stage = stage_of(model_config, ranks.place(spec.rank)[0], ranks.pp)
    model = load_model(config.model, model_config, spec.dtype, device, spec.max_model_len,
                       config.load_format, config.seed, config.quantization, comm.shard(),
                       stage)
    pack_model(model, config.cpu_kernels, device, spec.dtype)
    num_blocks = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(num_blocks, src=0, group=cpu_group)  # the engine sized the cache
    caches = attach_kv_caches(model, int(num_blocks) + 1, config.block_size,
                              KVCacheFormat(spec.dtype), device)
    backend = make_backend(config.attention_backend, device, config.block_size, spec.dtype,
                           spec.dtype)
    link = StageLink(device, config.block_size, model_config.hidden_size, spec.dtype,
                     cpu_group)
    previous, following = ranks.previous(spec.rank), ranks.following(spec.rank)
    log.info("pipeline stage %d of %d (layers %d-%d), tensor-parallel rank %d of %d, "
             "ready", stage.index, ranks.pp, stage.start, stage.end - 1,
             comm.shard().rank, ranks.tp)
    with torch.inference_mode():
        _run_steps(model, link, caches, backend, previous, following, stage.first)
    comm.destroy()


def _run_steps(model, link, caches, backend, previous: int, following: int | None,
               first: bool) -> None:
    """Every step from `previous` through this stage's layers, handed to `following`
    (0: the engine; None: none, the last stage), until the stop, which goes on."""
    from kvserve.engine.kernels.attention import (clear_attention_context, prepare_step,
                                                  set_attention_context)
    from kvserve.engine.models.kv_caches import copy_blocks

    device = link.device
    while (step := link.receive_step(previous, first)) is not None:
        copy_blocks(caches, step.copies)
        positions, common, _ = step.host.to_device(device)
        set_attention_context(backend, prepare_step(backend, common))
        try:
            hidden = model.forward_stage(step.inputs, positions)
        finally:
            clear_attention_context()
        if following is None:  # the last stage: its columns, gathered on the engine
            model.compute_logits(hidden[step.logit_rows.to(device)])
        elif following == 0:  # the engine has the step: the activations alone
            link.send_hidden(0, hidden)
        else:
            link.send_step(following, step.host, step.copies, hidden, step.logit_rows)
    if following:
        link.send_stop(following)
    link.drain()

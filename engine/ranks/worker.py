"""A tensor-parallel rank other than 0: `python -m kvserve.engine.ranks.worker SPEC`,
started by rank 0 (engine/ranks/group.py). It loads its part of the weights,
allocates its part of the KV cache, and runs every step rank 0 sends until told to
stop. It samples nothing: its share of the logits goes to rank 0. Under pipeline
parallelism the same command runs a pipeline rank instead (stage_worker.py, started
by engine/ranks/pipeline.py)."""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time

import torch

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.ranks.worker_spec import WorkerSpec

log = logging.getLogger("kvserve.tp_worker")


def _exit_with_parent(parent_pid: int) -> None:
    """A rank outlives no engine: killed or crashed, rank 0 says nothing more."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def serve(spec: WorkerSpec) -> None:
    import torch.distributed as dist

    from kvserve.engine.kernels.attention import (clear_attention_context, make_backend,
                                                  prepare_step, set_attention_context)
    from kvserve.engine.weights.cpu_packing import pack_model
    from kvserve.engine.models.kv_caches import (KVCacheFormat, attach_kv_caches, copy_blocks,
                                                 layer_groups)
    from kvserve.engine.weights.loader import load_model
    from kvserve.engine.models import tp_comm as comm
    from kvserve.engine.models.tp_shard import TPShard
    from kvserve.engine.ranks.step_channel import StepChannel

    config, device = spec.config, torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm.init(TPShard(spec.rank, spec.size), spec.port, device, spec.addr, spec.ranks_here)
    cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
    model_config = ModelConfig.from_pretrained(config.model)
    model = load_model(config.model, model_config, spec.dtype,
                       device, spec.max_model_len, config.load_format, config.seed,
                       config.quantization, comm.shard())
    pack_model(model, config.cpu_kernels, device, spec.dtype)
    num_blocks = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(num_blocks, src=0, group=cpu_group)  # rank 0 sized the cache
    caches = attach_kv_caches(model, int(num_blocks) + 1, config.block_size,
                              KVCacheFormat(spec.dtype), device,
                              layer_groups(model_config, config))  # rank 0's
    backend = make_backend(config.attention_backend, device, config.block_size, spec.dtype,
                           spec.dtype)
    channel = StepChannel(spec.channel, spec.rank, device, config.block_size, cpu_group,
                          spec.networked)
    log.info("rank %d of %d ready", spec.rank, spec.size)
    with torch.inference_mode():
        while (step := channel.receive()) is not None:
            copy_blocks(caches, step.copies)
            positions, common, _ = step.host.to_device(device)
            set_attention_context(backend, prepare_step(backend, common))
            try:
                hidden = model(step.input_ids, positions)
            finally:
                clear_attention_context()
            model.compute_logits(hidden[step.logit_rows])  # this rank's columns, gathered on rank 0
    comm.destroy()


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        spec: WorkerSpec = pickle.load(f)
    os.unlink(sys.argv[1])  # written for this worker alone
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s[rank {spec.rank}]: "
                        "%(message)s")
    threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    if spec.config.pipeline_parallel_size > 1:
        from kvserve.engine.ranks.stage_worker import serve_stage

        serve_stage(spec)
    else:
        serve(spec)


if __name__ == "__main__":
    main()

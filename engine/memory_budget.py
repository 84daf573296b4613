"""How big the KV cache may be on a GPU: --gpu-memory-utilization of the device's
memory, minus what the model needs besides the cache (weights, the peak activations
of the largest step, memory outside torch such as the CUDA context).

The peak comes from a profile run: one forward pass of --max-num-batched-tokens
prompt tokens through a throwaway cache, plus the logits and sampling tensors of
--max-num-seqs rows, measured with torch's peak-allocation counter."""
from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("kvserve.engine")


def kv_budget_bytes(total: int, utilization: float, peak_allocated: int,
                    non_torch: int) -> int:
    """Bytes left for the KV cache: utilization x total, minus the profile's peak
    (weights included) and memory torch does not account for. Never negative."""
    if not 0 < utilization <= 1:
        raise ValueError("gpu_memory_utilization must be in (0, 1]")
    return max(0, int(total * utilization) - peak_allocated - non_torch)


def profile_kv_budget(model, config, device: torch.device, dtype: torch.dtype,
                      kv_format) -> int:
    """Runs the profile step on `device` (CUDA) and returns the KV budget in bytes."""
    from engine.attention import make_backend
    from engine.model_runner import ModelRunner

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free_before) - torch.cuda.memory_reserved(device)
    tokens = config.max_num_batched_tokens
    blocks = math.ceil(tokens / config.block_size) + 1
    backend = make_backend(config.attention_backend, device, config.block_size, dtype,
                           kv_format.dtype)
    runner = ModelRunner(model, blocks, config.block_size, device, kv_format, backend)
    runner.profile_step(tokens, config.max_num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del runner
    torch.cuda.empty_cache()
    budget = kv_budget_bytes(total, config.gpu_memory_utilization, peak, non_torch)
    log.info("memory: %.2f GiB total x %.2f; peak of a %d-token step %.2f GiB "
             "(weights included), outside torch %.2f GiB -> KV cache %.2f GiB",
             total / 2**30, config.gpu_memory_utilization, tokens, peak / 2**30,
             non_torch / 2**30, budget / 2**30)
    return budget

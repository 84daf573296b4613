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

DEFAULT_CPU_KV_BYTES = 1 << 30


def num_kv_blocks(config, model_config, model, device: torch.device, dtype: torch.dtype,
                  kv_format, layer_groups=None) -> int:
    """--num-kv-blocks, else --kv-cache-memory, else on CUDA what
    --gpu-memory-utilization leaves after a profile step, else 1 GiB (CPU).
    layer_groups: a hybrid model's (a block then holds one layer group's K/V)."""
    from kvserve.engine.weights.loader import ModelLoadError
    from kvserve.engine.platform.device import check_fits

    per_block = kv_format.bytes_per_block(model_config, config.block_size, layer_groups)
    if config.num_kv_blocks or config.kv_cache_memory is not None:
        num = config.num_kv_blocks or config.kv_cache_memory // per_block
    elif device.type == "cuda":
        num = profile_kv_budget(model, config, device, dtype, kv_format) // per_block
    else:
        num = DEFAULT_CPU_KV_BYTES // per_block
    if num < 1:
        raise ModelLoadError("the KV cache budget is smaller than one block")
    check_fits(num * per_block, device, "the KV cache")
    return num


def log_kv_cache(num_blocks: int, block_size: int, kv_format, model_config,
                 max_model_len: int, layer_groups=None) -> None:
    per_token = kv_format.bytes_per_block(model_config, block_size, layer_groups) / block_size
    log.info("KV cache: %d blocks of %d tokens, %s, %.1f KiB a token (%d tokens, %.1fx "
             "concurrency at %d)", num_blocks, block_size,
             str(kv_format.dtype).removeprefix("torch."), per_token / 1024,
             num_blocks * block_size, num_blocks * block_size / max_model_len, max_model_len)
    if layer_groups is not None:
        every = kv_format.bytes_per_block(model_config, block_size) / block_size
        log.info("hybrid cache: a block holds one of %d layer groups (%d full-attention "
                 "layers, or as many sliding-window ones): %.1f KiB a token past the "
                 "%d-token window against %.1f KiB keeping every layer's",
                 1 + layer_groups.window_groups, layer_groups.num_tensors,
                 per_token / 1024, layer_groups.window, every / 1024)
    if model_config.mla is not None:
        full = full_kv_bytes_per_token(model_config, kv_format.dtype.itemsize)
        log.info("latent attention: %.1f KiB a token against %.1f KiB for every head's "
                 "keys and values (%.1fx less)", per_token / 1024, full / 1024,
                 full / per_token)


def full_kv_bytes_per_token(cfg, itemsize: int) -> int:
    """What a latent-attention model's cache would hold a token if it kept every
    head's key and value (the expanded form), for comparison."""
    mla = cfg.mla
    return cfg.num_layers * cfg.num_heads * (mla.qk_head_dim + mla.v_head_dim) * itemsize


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
    from kvserve.engine.kernels.attention import make_backend
    from kvserve.engine.runner.model_runner import ModelRunner

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free_before) - torch.cuda.memory_reserved(device)
    tokens = config.max_num_batched_tokens
    blocks = math.ceil(tokens / config.block_size) + 1
    backend = make_backend(config.attention_backend, device, config.block_size, dtype,
                           kv_format.dtype)
    runner = ModelRunner(model, num_blocks=blocks, block_size=config.block_size, device=device,
                         kv_format=kv_format, attn_backend=backend)
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

"""The model as the engine serves it: its weights loaded, quantized as --quantization
and the checkpoint say, packed for kvserve's CPU GEMM as --cpu-kernels says, and its
KV cache's format chosen (--kv-cache-dtype, whose fp8 scales are measured on the
loaded model)."""
from __future__ import annotations

import logging

import torch
from torch import nn

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.models.kv_caches import KVCacheFormat
from kvserve.engine.models.pipeline_stage import WHOLE, PipelineStage
from kvserve.engine.models.tp_shard import SINGLE, TPShard
from kvserve.engine.weights.cpu_packing import pack_model, quantized_panels_here
from kvserve.engine.weights.loader import load_model, resolve_load_format
from kvserve.engine.weights.quantization import model_bytes, quantize_model
from kvserve.engine.weights.quantization.awq import calibration_inputs
from kvserve.engine.weights.quantization.kv_fp8 import kv_cache_format

log = logging.getLogger("kvserve.engine")


def load_served_model(config: EngineConfig, cfg: ModelConfig, tokenizer,
                      device: torch.device, dtype: torch.dtype,
                      max_model_len: int, shard: TPShard = SINGLE,
                      stage: PipelineStage = WHOLE) -> tuple[nn.Module, KVCacheFormat]:
    """shard: the tensor-parallel rank's part of the weights (rank 0's here); stage:
    the pipeline stage's layers (the last stage's here)."""
    load_format = resolve_load_format(config.model, config.load_format)
    # Asked of GGUF files alone: it waits for the kernels' build, which a float
    # checkpoint's load (its conversion, on a cold start) leaves running beside it.
    panels_here = load_format == "gguf" and quantized_panels_here(config.cpu_kernels,
                                                                   device, dtype)
    model = load_model(config.model, cfg, dtype, device, max_model_len, load_format,
                       config.seed, config.quantization, shard, stage,
                       panels_here=panels_here)
    online = load_format != "gguf"  # a GGUF's blocks are quantized as the file says
    if online:
        quantize_model(model, config.quantization, config.quantization_group_size,
                       lambda: calibration_inputs(model, tokenizer, device, dtype))
    pack_model(model, config.cpu_kernels, device, dtype,
               int8_head=online and config.quantization.startswith("int"))
    log.info("weights: %.1f MiB (%s, quantization %s)", model_bytes(model) / 2**20,
             str(dtype).replace("torch.", ""), config.quantization)
    return model, kv_cache_format(config.kv_cache_dtype, model, tokenizer, device, dtype)

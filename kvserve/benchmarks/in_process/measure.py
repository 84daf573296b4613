"""What the decode benchmark measures with, for kvserve and for transformers alike
(decode.py, hf_decode.py): the prompt, the rows of the result, the device's memory."""
from __future__ import annotations

import gc
import random

import torch

from kvserve.benchmarks.in_process.utilisation import bytes_per_decode_step
from kvserve.engine.config.model_config import ModelConfig

DECODE_PROMPT_LEN = 128


def make_prompt(vocab: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, vocab) for _ in range(length)]


def decode_row(cfg: ModelConfig, dtype: torch.dtype, step_s: float, new_tokens: int,
               weights: int | None = None, kv_dtype: torch.dtype | None = None) -> dict:
    """`weights`: the loaded model's bytes where known (quantized weights); kv_dtype:
    the KV cache's where it is not `dtype` (an fp8 cache)."""
    read = bytes_per_decode_step(cfg, dtype, DECODE_PROMPT_LEN + new_tokens / 2, weights,
                                 kv_dtype)
    return {"tok_s": 1 / step_s, "step_ms": step_s * 1e3,
            "bytes_read_per_step": read["total"],
            "achieved_read_gbps": read["total"] / step_s / 1e9}


def split_row(first_token_s: float, decode_s: float, new_tokens: int) -> dict:
    total = first_token_s + decode_s
    return {"prefill_s": first_token_s, "decode_s": decode_s, "total_s": total,
            "decode_share": decode_s / total,
            "decode_ms_per_token": decode_s / (new_tokens - 1) * 1e3}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    """Most bytes allocated on CUDA since the reset: loading weights of N bytes should
    peak near N plus the KV cache, never at a float32 copy (2N for bf16)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_compile(args) -> str:
    """A timed run measures one forward pass: compiled before the first step (on CPU
    under auto), never halfway through."""
    if args.compile == "background":
        return "wait"
    if args.compile == "auto":
        from kvserve.engine.platform.device import resolve_device
        return "wait" if resolve_device(args.device).type == "cpu" else "off"
    return args.compile

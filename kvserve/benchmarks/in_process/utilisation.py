"""The arithmetic behind MBU and MFU, and the peaks they are measured against.

MBU (model-bandwidth utilisation): bytes a decode step must read / step time / the
copy bandwidth measured on the same device in the same run.
MFU (model FLOP/s utilisation): FLOPs a prefill must do / its time / the device's peak:
a spec-sheet number for known GPUs (dense bf16 tensor math, no sparsity), else a large
matmul measured in the run's dtype (the CPU, an unknown GPU, or float32 on a GPU)."""
from __future__ import annotations

import statistics
import time

import torch

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.models.kv_caches import KVCacheFormat
from kvserve.modelstore.weight_bytes import weight_bytes

# Dense bf16 TFLOP/s by a substring of torch.cuda.get_device_name, first match wins.
GPU_PEAK_BF16_TFLOPS = (
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),  # the A10 is 125; AWS's A10G has half-rate fp32-accumulate tensor math
    ("RTX 4090", 165.0),
)


def table_peak_tflops(device_name: str) -> tuple[str, float] | None:
    """('H100', 989.0) for 'NVIDIA H100 80GB HBM3'; None for a GPU not in the table."""
    name = device_name.upper()
    return next(((key, tflops) for key, tflops in GPU_PEAK_BF16_TFLOPS if key in name), None)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights of one decoder layer's matrix multiplies, times the layers: what every
    token of a prompt is multiplied with (norms and the embedding lookup are not
    matmuls; the output head is counted apart, see prefill_flops)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    return cfg.num_layers * (attn + 3 * h * cfg.intermediate_size)


def attention_flops(cfg: ModelConfig, context_sum: float) -> float:
    """QK^T and PV: 4 x layers x attention width x keys attended, summed over the
    queries. The width is heads x head_dim (the hidden size for Llama shapes)."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context_sum


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """One prompt of `tokens` computed at once: 2 FLOPs per multiplied weight per token,
    causal attention (token i attends to i keys, so T(T+1)/2 in all), and the output
    head for the last position only (the engine takes logits for that row alone)."""
    head = cfg.vocab_size * cfg.hidden_size
    return (2 * matmul_params(cfg) * tokens + 2 * head
            + attention_flops(cfg, tokens * (tokens + 1) / 2))


def bytes_per_decode_step(cfg: ModelConfig, dtype: torch.dtype, context: float,
                          weights: int | None = None,
                          kv_dtype: torch.dtype | None = None) -> dict:
    """Least bytes one batch-1 decode step reads: every weight once, except an
    embedding table the LM head does not read (one row of it), plus the KV of the
    whole context. `weights`: what the loaded model reads a step
    (weights_read_per_step: quantized or packed weights), else the model's size in
    `dtype`; the KV in `kv_dtype` (default `dtype`), counted as the engine
    allocates it."""
    if weights is None:
        weights = weight_bytes(cfg, dtype.itemsize)
        if not cfg.tie_word_embeddings:
            weights -= (cfg.vocab_size - 1) * cfg.hidden_size * dtype.itemsize
    kv_per_token = KVCacheFormat(kv_dtype or dtype).bytes_per_block(cfg, 1)
    return {"weights": weights, "kv": int(kv_per_token * context),
            "total": int(weights + kv_per_token * context)}


def weights_read_per_step(model) -> int:
    """The loaded model's weight bytes a decode step reads: all of them, but only a
    row of the embedding table unless the LM head multiplies by that very table
    (tied; or packed, the embedding reading the head's panels)."""
    from kvserve.engine.weights.quantization import model_bytes

    table = model.embed_tokens.weight
    if table is None or model.lm_head.weight is table:
        return model_bytes(model)
    return model_bytes(model) - table.nbytes + table[0].nbytes


def mbu(bytes_per_step: float, step_s: float, copy_gbps: float) -> float:
    """Share of the measured copy bandwidth one decode step's reads reach."""
    return bytes_per_step / step_s / 1e9 / copy_gbps


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Share of the peak FLOP/s reached."""
    return flops / seconds / (peak_tflops * 1e12)


class Clock:
    """Wall time that waits for the device's queued work at both ends."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def copy_bandwidth(device: torch.device, mib: int, repeats: int) -> dict:
    """Median GB/s of `dst.copy_(src)`, bytes read plus written."""
    n = mib * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).normal_()  # never zeros
    dst = torch.empty_like(src)
    clock, inner, times = Clock(device), 10, []
    dst.copy_(src)  # warm-up
    for _ in range(repeats):
        t0 = clock.now()
        for _ in range(inner):
            dst.copy_(src)
        times.append((clock.now() - t0) / inner)
    del src, dst
    t = statistics.median(times)
    return {"buffer_bytes": n * 4, "copy_s": t, "gbps": 2 * n * 4 / t / 1e9}


def measured_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int,
                           repeats: int) -> float:
    """Best TFLOP/s of an n x n by n x n matmul (2 n^3 FLOPs) over `repeats` timings."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    clock = Clock(device)
    inner = 10 if device.type == "cuda" else 1
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(max(repeats, 2)):
        t0 = clock.now()
        for _ in range(inner):
            torch.mm(a, b)
        best = min(best, (clock.now() - t0) / inner)
    return 2 * size**3 / best / 1e12


def peak_tflops(device: torch.device, dtype: torch.dtype, matmul_size: int | None,
                repeats: int) -> dict:
    """{'tflops', 'source'}: the table's number for a known GPU running bf16/fp16,
    else a matmul measured here in `dtype` (default 2048 on the CPU, 8192 on a GPU)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        known = table_peak_tflops(torch.cuda.get_device_name(device))
        if known is not None:
            return {"tflops": known[1], "source": f"spec sheet: {known[0]} dense bf16"}
    size = matmul_size or (8192 if device.type == "cuda" else 2048)
    dtype_name = str(dtype).replace("torch.", "")
    return {"tflops": measured_matmul_tflops(device, dtype, size, repeats),
            "source": f"measured: {size}x{size} {dtype_name} matmul"}

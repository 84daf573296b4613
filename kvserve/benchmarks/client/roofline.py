"""Roofline estimates for serving one model on one GPU.

Decode is memory-bound at small batches: every step reads all the weights once (an
untied input embedding only one row per sequence) plus every running sequence's KV,
so a step takes bytes / bandwidth. Prefill is compute-bound: 2 FLOPs per weight per
token, plus causal attention. Each phase takes the slower of its memory time and its
compute time. `mbu`/`mfu` (measured fractions of peak bandwidth/FLOP/s) scale the
peaks down to what the kernels actually reach."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.benchmarks.client.gpus import GPU
from kvserve.benchmarks.client.model_shape import ModelShape
from kvserve.modelstore.weight_bytes import weight_bytes


@dataclass(frozen=True)
class Setup:
    shape: ModelShape
    gpu: GPU
    dtype_bytes: float = 2
    kv_dtype_bytes: float = 2
    memory_utilization: float = 0.9
    mbu: float = 1.0
    mfu: float = 1.0
    quantization: str = "none"  # of the decoder projections (modelstore/weight_bytes.py)
    group_size: int = 32

    @property
    def weight_bytes(self) -> float:
        return weight_bytes(self.shape, self.dtype_bytes, self.quantization, self.group_size)

    @property
    def kv_per_token(self) -> float:
        return self.shape.kv_bytes_per_token(self.kv_dtype_bytes)

    def bandwidth(self) -> float:
        return self.gpu.bandwidth_tb_s * 1e12 * self.mbu

    def flops(self) -> float:
        return self.gpu.bf16_tflops * 1e12 * self.mfu


def kv_budget_bytes(s: Setup) -> float:
    """What is left for the KV cache: the usable share of memory minus the weights."""
    return s.gpu.memory_gb * 1e9 * s.memory_utilization - s.weight_bytes


def max_sequences(s: Setup, seq_len: int) -> int:
    return max(0, int(kv_budget_bytes(s) // (s.kv_per_token * seq_len)))


def decode_weight_bytes(s: Setup) -> float:
    shape = s.shape
    unread = 0 if shape.tie_word_embeddings else (shape.vocab_size - 1) * shape.hidden_size
    return s.weight_bytes - unread * s.dtype_bytes


def attention_flops(shape: ModelShape, queries: float, keys: float) -> float:
    """QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add over queries x keys."""
    return 4 * shape.num_layers * shape.num_heads * shape.head_dim * queries * keys


def decode_step_s(s: Setup, batch: int, context: float) -> tuple[float, str]:
    """(seconds per decode step, which roof binds) with `batch` sequences of `context`."""
    memory = (decode_weight_bytes(s) + batch * context * s.kv_per_token) / s.bandwidth()
    flops = 2 * s.shape.matmul_params() * batch + attention_flops(s.shape, batch, context)
    compute = flops / s.flops()
    return (memory, "memory") if memory >= compute else (compute, "compute")


def prefill_s(s: Setup, prompt_len: int) -> tuple[float, str]:
    """One prompt alone on the GPU; causal attention sees prompt_len/2 keys on average."""
    flops = (2 * s.shape.matmul_params() * prompt_len
             + attention_flops(s.shape, prompt_len, prompt_len / 2))
    compute, memory = flops / s.flops(), s.weight_bytes / s.bandwidth()
    return (compute, "compute") if compute >= memory else (memory, "memory")

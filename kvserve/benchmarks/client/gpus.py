"""Accelerator spec-sheet numbers for the roofline. Bandwidth is HBM/GDDR peak, FLOP/s
is dense bf16/fp16 tensor math (no sparsity) with fp32 accumulation, memory is decimal
GB. Real kernels reach a fraction of these (see `estimate --calibrate`).

Prices are rough on-demand $/GPU-hour defaults for tokens-per-dollar; they differ a
lot between clouds, so edit them here or pass --price-per-hour."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth_tb_s: float
    bf16_tflops: float
    memory_gb: float
    price_per_hour: float


GPUS = {
    "h100": GPU("H100 SXM 80GB", 3.35, 989.0, 80, 3.00),
    "h200": GPU("H200 SXM 141GB", 4.8, 989.0, 141, 3.80),
    "a100": GPU("A100 SXM 80GB", 2.039, 312.0, 80, 1.80),
    "l40s": GPU("L40S 48GB", 0.864, 362.0, 48, 1.00),
    # AWS's A10G: GA102 with half-rate fp32-accumulate tensor math (the A10 is 125).
    "a10g": GPU("A10G 24GB", 0.6, 70.0, 24, 1.01),
    # GeForce: 165 dense with fp32 accumulation (330 with fp16 accumulation).
    "rtx4090": GPU("RTX 4090 24GB", 1.008, 165.2, 24, 0.40),
}


def get_gpu(name: str) -> GPU:
    key = name.lower().replace("-", "").replace(" ", "")
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]

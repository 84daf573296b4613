"""kvserve's own kernels: the CPU library (cpu/), the attention backends
(attention/), LoRA's Triton kernels and their reference (lora/)."""

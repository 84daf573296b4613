"""Multi-LoRA serving (issue 22): PEFT adapters read and checked (adapter.py), the
engine's registry of them (manager.py), the resident ones' stacked buffers
(slots.py), and adapters loaded and unloaded while serving (runtime.py). One step's
inputs and product: engine/models/lora_step.py (dense matmuls on CPU, the BGMV
Triton kernels of engine/kernels/lora/ on CUDA)."""

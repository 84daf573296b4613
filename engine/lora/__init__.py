"""Multi-LoRA serving (issue 22): PEFT adapters read and checked (adapter.py), the
engine's registry of them (manager.py), the resident ones' stacked buffers
(slots.py), and one step's inputs and product (step.py: dense matmuls on CPU, the
BGMV Triton kernels of triton_kernels.py on CUDA; batched.py is their reference)."""

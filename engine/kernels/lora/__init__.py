"""One step's LoRA product: the BGMV Triton kernels on CUDA (triton_kernels.py) and
the dense reference they are checked against (batched.py)."""

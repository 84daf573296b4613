"""A model as the engine serves it: read from a checkpoint (loader.py: safetensors;
gguf_loader.py: GGUF blocks), quantized at load and calibrated (quantization/),
packed for kvserve's CPU kernels (cpu_packing.py), and its KV cache format chosen
(model_setup.py)."""

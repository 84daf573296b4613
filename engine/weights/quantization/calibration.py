"""The calibration pass shared by the methods that measure the model at load
(activation-aware weight scales, the fp8 KV cache's scales): the first
CALIBRATION_TOKENS tokens of calibration.txt (the Declaration of Independence's
preamble, the Gettysburg Address, a little code and JSON; public domain, and a
different text from the one bench/quality.py scores) through the model as loaded,
as one prompt over a throwaway paged KV cache in the model's dtype."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kvserve.engine.kernels.attention import clear_attention_context, set_attention_context
from kvserve.engine.kernels.attention.selector import make_backend
from kvserve.engine.kernels.attention.step_metadata import build_host_step
from kvserve.engine.models.kv_caches import KVCacheFormat, attach_kv_caches
from kvserve.modelstore.errors import ModelLoadError

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
CALIBRATION_TOKENS = 512
BLOCK = 16  # the pass's own KV cache; the runner attaches the real one afterwards


def calibration_tokens(tokenizer, purpose: str) -> list[int]:
    if tokenizer is None:
        raise ModelLoadError(f"{purpose} reads a calibration text: it needs the model's "
                             "tokenizer")
    tokens = tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"))
    return tokens[:CALIBRATION_TOKENS]


@torch.inference_mode()
def run_calibration_prompt(model: nn.Module, tokens: list[int], device: torch.device,
                           dtype: torch.dtype) -> None:
    """One prompt through the model; afterwards each layer's attention still points
    at the throwaway cache, which holds the prompt's K/V (read by kv_fp8.py). Cut
    to the positions the model was built for (--max-model-len may be shorter than
    the text)."""
    tokens = tokens[:model.rotary.max_positions]
    blocks = -(-len(tokens) // BLOCK)
    attach_kv_caches(model, blocks, BLOCK, KVCacheFormat(dtype), device)
    backend = make_backend("torch", device, BLOCK, dtype)
    host = build_host_step([0], [len(tokens)], [list(range(blocks))], BLOCK)
    positions, common, (ids,) = host.to_device(device, [torch.tensor(tokens)])
    set_attention_context(backend, backend.prepare(common))
    try:
        model(ids, positions)
    finally:
        clear_attention_context()

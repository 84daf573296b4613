"""Activation-aware scaling of quantized weights (--quantization int4-awq | int8-awq),
AWQ's idea (Lin et al., 2023): a few input channels carry activations orders of
magnitude larger than the rest, and their weights' rounding error is multiplied by
them. Scaling those weights' columns up by s (and the inputs down by s, exact in
float) gives them more of the grid. Per projection, s = mean|x| ** alpha over a
calibration text, alpha searched in 0, 0.1, .., 1 for the least output error of the
quantized projection on that text; alpha 0 is plain round-to-nearest, so the
search never does worse there than round-to-nearest.

The calibration text (calibration.txt: the Declaration of Independence's preamble,
the Gettysburg Address, a little code and JSON; public domain, and a different text
from the one bench/quality.py scores) runs once through the float model at load."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from engine.attention import clear_attention_context, set_attention_context
from engine.attention.selector import make_backend
from engine.attention.step_metadata import build_host_step
from engine.kv_caches import attach_kv_caches
from modelstore.errors import ModelLoadError

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
CALIBRATION_TOKENS = 512
ALPHAS = tuple(i / 10 for i in range(11))
BLOCK = 16  # the calibration pass's own KV cache; the runner attaches the real one


def decoder_linears(model: nn.Module):
    """(name, parent, attribute, linear) of every projection in the decoder layers."""
    for name, parent in model.layers.named_modules(prefix="layers"):
        for attr, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                yield f"{name}.{attr}", parent, attr, child


def calibration_inputs(model: nn.Module, tokenizer, device: torch.device,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each decoder projection's inputs over the calibration text, [T, K] float32."""
    if tokenizer is None:
        raise ModelLoadError("activation-aware quantization reads a calibration text: "
                             "it needs the model's tokenizer")
    tokens = tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"))
    tokens = tokens[:CALIBRATION_TOKENS]
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        return lambda _module, args: captured.__setitem__(name, args[0].float().clone())

    hooks = [linear.register_forward_pre_hook(keep(name))
             for name, _, _, linear in decoder_linears(model)]
    try:
        _forward(model, tokens, device, dtype)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


@torch.inference_mode()
def _forward(model: nn.Module, tokens: list[int], device: torch.device,
             dtype: torch.dtype) -> None:
    """One prompt through the model, over a throwaway paged KV cache."""
    blocks = -(-len(tokens) // BLOCK)
    attach_kv_caches(model, blocks, BLOCK, dtype, device)
    backend = make_backend("torch", device, BLOCK, dtype)
    host = build_host_step([0], [len(tokens)], [list(range(blocks))], BLOCK)
    positions, common, (ids,) = host.to_device(device, [torch.tensor(tokens)])
    set_attention_context(backend, backend.prepare(common))
    try:
        model(ids, positions)
    finally:
        clear_attention_context()


def search_scales(weight: torch.Tensor, inputs: torch.Tensor,
                  fake_quantize: Callable[[torch.Tensor], torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    """The input scales s (in `dtype`, [K]) of least error ||x W'^T - x W^T||, with
    W' = fake_quantize(W * s) / s."""
    w = weight.float()
    x = inputs.float()
    reference = x @ w.T
    mean_abs = x.abs().mean(dim=0).clamp(min=1e-6)
    best, best_error = torch.ones_like(mean_abs), float("inf")
    for alpha in ALPHAS:
        s = mean_abs.pow(alpha)
        s = (s / (s.max() * s.min()).sqrt()).to(dtype).float()  # the scale the layer keeps
        error = (x @ (fake_quantize(w * s) / s).T - reference).pow(2).mean().item()
        if error < best_error:
            best, best_error = s, error
    return best.to(dtype)

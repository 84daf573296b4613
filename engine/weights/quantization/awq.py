"""Activation-aware scaling of quantized weights (--quantization int4-awq | int8-awq),
AWQ's idea (Lin et al., 2023): a few input channels carry activations orders of
magnitude larger than the rest, and their weights' rounding error is multiplied by
them. Scaling those weights' columns up by s (and the inputs down by s, exact in
float) gives them more of the grid. Per projection, s = mean|x| ** alpha over a
calibration text, alpha searched in 0, 0.1, .., 1 for the least output error of the
quantized projection on that text; alpha 0 is plain round-to-nearest, so the
search never does worse there than round-to-nearest.

The calibration text (calibration.py) runs once through the float model at load."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kvserve.engine.weights.quantization.calibration import (calibration_tokens,
                                                             run_calibration_prompt)

ALPHAS = tuple(i / 10 for i in range(11))


def decoder_linears(model: nn.Module):
    """(name, parent, attribute, linear) of every projection in the decoder layers."""
    for name, parent in model.layers.named_modules(prefix="layers"):
        for attr, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                yield f"{name}.{attr}", parent, attr, child


def calibration_inputs(model: nn.Module, tokenizer, device: torch.device,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each decoder projection's inputs over the calibration text, [T, K] float32."""
    tokens = calibration_tokens(tokenizer, "activation-aware quantization")
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        return lambda _module, args: captured.__setitem__(name, args[0].float().clone())

    hooks = [linear.register_forward_pre_hook(keep(name))
             for name, _, _, linear in decoder_linears(model)]
    try:
        run_calibration_prompt(model, tokens, device, dtype)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


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

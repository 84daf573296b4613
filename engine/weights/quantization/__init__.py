"""Quantized weights: which layers are quantized, and how (--quantization).

Online quantization (as vLLM's --quantization fp8) rounds a float checkpoint's
decoder projections at load (a mixture-of-experts model's routed experts too, in
int8 or int4; never its router): int8 (int8.py, one scale per output channel), int4
(int4.py, a scale and a minimum per group of 32 inputs; int4-sym a scale alone, GGUF
Q4_0's grid, the experts staying int4) or, on Ada/Hopper GPUs, fp8
(fp8.py: e4m3 weights and per-token e4m3 activations); the layer kinds live in
engine/models/quantized/. A GGUF checkpoint's own
quantized blocks are repacked into the same layers instead (engine/weights/gguf_loader.py).
The embeddings and the LM head stay in the model dtype here; where kvserve's CPU
kernels pack the model, a quantized model's head (and tied table) is rounded to
GGUF's Q8_0 as it is packed (engine/weights/cpu_packing.py: pack_model's int8_head),
measured to cost no perplexity."""
from __future__ import annotations

import logging
from functools import partial
from typing import Callable

import torch
from torch import nn

from kvserve.engine.models.moe import FusedExperts, SparseMoE
from kvserve.engine.models.quantized.fp8 import Fp8Linear, check_fp8_device, check_fp8_shapes
from kvserve.engine.models.quantized.int4 import PACK_ROWS, Int4Linear, fake_quantize_int4
from kvserve.engine.models.quantized.int8 import Int8Linear, fake_quantize_int8
from kvserve.engine.weights.quantization.awq import decoder_linears, search_scales
from kvserve.modelstore.errors import ModelLoadError

log = logging.getLogger("kvserve.loader")

# auto: the checkpoint's own (a GGUF's quantized blocks stay quantized, float
# weights stay float); none: every weight in --dtype; -awq: activation-aware scales;
# int4-sym: GGUF Q4_0's symmetric grid (no minimums: 4.5 bits a weight on CPU, not 5).
MODES = ("auto", "none", "int8", "int4", "int4-sym", "int8-awq", "int4-awq", "fp8")


def quantize_model(model: nn.Module, mode: str, group_size: int = 32,
                   calibration: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
    """In place: every linear layer of the decoder layers becomes `mode`'s (int4:
    `group_size` inputs share a scale and a minimum). An -awq mode calls
    `calibration` for each projection's inputs on the calibration text first."""
    if mode in ("auto", "none"):
        return
    if mode == "fp8":
        return quantize_fp8_model(model)
    kind, _, method = mode.partition("-")
    if kind == "int4":
        check_int4_shapes(model, group_size)
    inputs = calibration() if method == "awq" else {}
    symmetric = method == "sym"
    fake = fake_quantize_int8 if kind == "int8" else partial(fake_quantize_int4,
                                                              group_size=group_size)
    for name, parent, attr, linear in decoder_linears(model):
        if isinstance(parent, SparseMoE):
            continue  # the router (and a shared expert's gate): choices stay exact
        scales = None
        if name in inputs:
            scales = search_scales(linear.weight, inputs[name], fake, linear.weight.dtype)
        setattr(parent, attr, Int8Linear.of(linear, scales) if kind == "int8"
                else Int4Linear.of(linear, group_size, scales, symmetric))
    quantize_experts(model, kind, group_size)


def quantize_experts(model: nn.Module, kind: str, group_size: int = 32) -> None:
    """A mixture-of-experts model's routed experts in int8 (a scale per row) or int4
    (codes two to a byte, a scale and a minimum per group of `group_size` inputs):
    the fused-experts op reads them, through kvserve's kernel on CPU and widened as
    they are loaded in the Triton GEMMs on CUDA."""
    for module in (m for m in model.modules() if isinstance(m, FusedExperts)):
        module.quantize_int8() if kind == "int8" else module.quantize_int4(group_size)


def _check_expert_groups(experts: FusedExperts, group_size: int) -> None:
    for name in ("w13", "w2"):
        _check_groups(f"the experts' ({name})", getattr(experts, name).shape[-1], group_size)


def _check_groups(what: str, inputs: int, group_size: int) -> None:
    """A start-up error unless groups of group_size tile `inputs`, naming the sizes
    that would."""
    if inputs % group_size:
        works = [g for g in (32, 64, 128) if inputs % g == 0]
        raise ModelLoadError(f"--quantization-group-size {group_size} does not divide "
                             f"{what} {inputs} inputs; this model takes "
                             f"{' or '.join(map(str, works)) or 'none of 32, 64, 128'}")


def quantize_fp8_model(model: nn.Module) -> None:
    """fp8.py's layers for every decoder projection, where the device has fp8 GEMMs."""
    check_fp8_device(next(model.parameters()).device)
    linears = list(decoder_linears(model))
    check_fp8_shapes((name, linear) for name, _, _, linear in linears)
    for _, parent, attr, linear in linears:
        setattr(parent, attr, Fp8Linear.of(linear))


def check_int4_shapes(model: nn.Module, group_size: int) -> None:
    """Whole groups in every projection's and routed expert's inputs, and rows in
    the CPU kernel's blocks of 64, or a start-up error naming what would work."""
    for name, parent, _, linear in decoder_linears(model):
        if isinstance(parent, SparseMoE):
            continue  # the router stays float (quantize_model)
        rows, cols = linear.weight.shape
        _check_groups(f"{name}'s", cols, group_size)
        if rows % PACK_ROWS:
            raise ModelLoadError(f"int4 keeps rows in blocks of {PACK_ROWS}; {name} has "
                                 f"{rows}: use --quantization int8")
    for experts in (m for m in model.modules() if isinstance(m, FusedExperts)):
        _check_expert_groups(experts, group_size)


def model_bytes(model: nn.Module) -> int:
    """What the model's weights hold in memory (a tied weight counted once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def resident_bytes(model: nn.Module) -> int:
    """The bytes of the model's weights in memory, rope tables left out (each tensor
    counted once: a tied head is its table)."""
    tables = {id(t) for r in model.rotaries() for t in r.buffers()}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in tables}
    return sum(t.numel() * t.element_size() for t in tensors.values())

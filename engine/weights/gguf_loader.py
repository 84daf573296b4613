"""Build our model from a GGUF file (--load-format gguf) of a llama (Mixtral's too:
llama with experts), qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3, phi3, gpt-oss
or deepseek2 (DeepSeek-V2 and V3) architecture. Its quantized projections
(Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants Q2_K..Q6_K, IQ4_NL/IQ4_XS, in any mix, as
Q4_K_M and Q5_K_M files have them) become int4 or group-int8 layers holding the
file's own integers and scales (no float copy of them is ever made); every other
tensor is de-quantized by gguf into --dtype (F32/F16/BF16 exactly, the rest
expanded, logged). The routed experts' [E, N, K] tensors likewise (gguf_experts.py).
--quantization none expands everything. The model's config and tokenizer come from
the directory's config.json and tokenizer files, as for safetensors, or from the
file's metadata (engine/platform/gguf_config.py)."""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.platform.gguf_checkpoint import FLOAT_TYPES, GGUFCheckpoint, find_gguf
from kvserve.engine.models.decoder import DecoderModel
from kvserve.engine.models.moe import SparseMoE
from kvserve.engine.models.registry import model_class
from kvserve.engine.models.quantized.layer import QuantizedLinear
from kvserve.engine.weights.gguf_experts import (expand_experts, expert_names,
                                                 fill_expert_biases, keep_experts)
from kvserve.engine.weights.gguf_names import CLASS_NAMES, LAYER_NAMES, PROJECTIONS, our_names
from kvserve.engine.weights.gguf_names import sources
from kvserve.engine.weights.gguf_layers import keep_vocabulary, repack
from kvserve.engine.weights.quantization import resident_bytes
from kvserve.modelstore.errors import ModelLoadError

log = logging.getLogger("kvserve.loader")

def load_gguf_model(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype,
                    device: torch.device, max_positions: int,
                    quantization: str, panels_here: bool = False) -> DecoderModel:
    """panels_here: kvserve's CPU GEMM will pack the quantized layers (keep_vocabulary)."""
    if quantization not in ("auto", "none"):
        raise ModelLoadError(f"--quantization {quantization} quantizes float weights at "
                             "load; a GGUF's weights are quantized already: use --quantization "
                             "auto to serve its blocks as they are, or none to expand them")
    cls = model_class(cfg)
    if cls not in CLASS_NAMES:
        raise ModelLoadError(f"GGUF files load for Llama, Mistral, Qwen2, Qwen3, Mixtral, "
                             f"Qwen2-MoE, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3, gpt-oss and DeepSeek-V2/V3; "
                             f"{cfg.architecture} loads from safetensors")
    ckpt = GGUFCheckpoint(find_gguf(model_dir))
    with torch.device("meta"):
        model = cls(cfg, max_positions).to(dtype)  # no storage yet
    names = our_names(ckpt, cfg.num_layers, {**LAYER_NAMES, **CLASS_NAMES[cls]})
    tied = cfg.tie_word_embeddings or "output.weight" not in ckpt.tensors  # llama.cpp ties then
    if tied:
        names.pop("output.weight", None)
    kept: Counter = Counter()
    repacked: set[str] = set()
    if quantization == "auto":
        for i, layer in enumerate(model.layers):
            for proj in PROJECTIONS:
                weights, biases = sources(names, i, proj), sources(names, i, proj, "bias")
                kind = repack(ckpt, layer, proj, weights, biases, dtype, device)
                if kind is not None:
                    kept[kind] += 1
                    repacked.update(weights + biases)
        kept.update(keep_vocabulary(ckpt, model, names, tied, dtype, device, panels_here))
    # Kept experts: read by kvserve's CPU kernel, or widened tile by tile in CUDA's
    # Triton grouped GEMMs (engine/kernels/moe/triton_experts.py).
    experts = _place_experts(ckpt, model, quantization == "auto", kept,
                             device)  # (and gives every float tensor storage)
    if tied and hasattr(model.lm_head, "weight"):  # both float: one copy
        model.lm_head.weight = model.embed_tokens.weight
    expert_tensors = {n for i in experts for kind in ("weight", "bias")
                      for n in expert_names(i, kind).values()}
    expanded = _fill_floats(model, ckpt, {g: n for g, n in names.items()
                                          if g not in repacked and g not in expert_tensors},
                            {f"layers.{i}.mlp.experts.{w}" for i, held in experts.items()
                             for w in (("b13", "b2") if held else ("w13", "w2", "b13", "b2"))})
    expanded.update(ckpt.type_name(n) for i, held in experts.items() if not held
                    for n in expert_names(i).values() if ckpt.type_name(n) not in FLOAT_TYPES)
    log.info("%s: %s tensors kept quantized, %s; %.1f MiB of weights resident for %.1f MiB "
             "in the file", ckpt.path.name, dict(kept) or "no", _expanded_summary(expanded),
             resident_bytes(model) / 2**20, ckpt.tensor_bytes() / 2**20)
    return model.eval().requires_grad_(False)


def _place_experts(ckpt: GGUFCheckpoint, model: DecoderModel, keep: bool, kept: Counter,
                   device: torch.device) -> dict[int, bool]:
    """Each mixture-of-experts layer's experts kept in their blocks where `keep` and
    its tensors' types allow (counted in `kept`), before every other tensor gets
    storage (_materialize); then the rest expanded and the experts' biases filled.
    Returns {layer: kept}."""
    experts = {i: layer.mlp.experts for i, layer in enumerate(model.layers)
               if isinstance(layer.mlp, SparseMoE)}
    held = {}
    for i, module in experts.items():
        kind = keep_experts(ckpt, module, i, device) if keep else None
        held[i] = kind is not None
        if kind is not None:
            kept[f"experts {kind}"] += 1
    _materialize(model, device)
    for i, module in experts.items():
        if not held[i]:
            expand_experts(ckpt, module, i)
        fill_expert_biases(ckpt, module, i)
    return held


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Storage on `device` for every tensor still on the meta device (the float
    ones), each alone: a module may hold kept blocks beside float tensors (gpt-oss's
    experts: their biases), which to_empty would replace too."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.is_meta:
                setattr(module, name, nn.Parameter(torch.empty_like(param, device=device),
                                                   requires_grad=param.requires_grad))
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                setattr(module, name, torch.empty_like(buffer, device=device))
    for rotary in model.rotaries():
        rotary.materialize(device)


def _fill_floats(model: DecoderModel, ckpt: GGUFCheckpoint, names: dict,
                 filled_already: set[str] = frozenset()) -> Counter:
    """Copy the tensors `names` maps (those not repacked) into the model's float
    parameters (`filled_already`: ones the caller filled); returns the counts of
    quantized types expanded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expanded: Counter = Counter()
    filled = set(filled_already)
    for gguf_name, (ours, shard) in names.items():
        kind = ckpt.type_name(gguf_name)
        if kind not in FLOAT_TYPES:
            expanded[kind] += 1
        tensor = ckpt.float_tensor(gguf_name)
        if shard is not None:
            module_name, _, attr = ours.rpartition(".")
            model.get_submodule(module_name).load_shard(attr, shard, tensor)
        else:
            if tensor.dim() == 1 and params[ours].shape == (1, len(tensor)):
                tensor = tensor[None]  # a one-row matrix written as a vector
            # Gemma's norms scale by (1 + w): llama.cpp's converter writes 1 + w.
            offset = getattr(model.get_submodule(ours.rpartition(".")[0]), "weight_offset", 0)
            if offset:
                tensor = tensor - offset
            if params[ours].shape != tensor.shape:
                raise ModelLoadError(f"{gguf_name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(params[ours].shape)}")
            params[ours].data.copy_(tensor)
        filled.add(ours)
    repacked = {id(p) for m in model.modules() if isinstance(m, QuantizedLinear)
                for p in m.parameters()}  # their biases came with their blocks
    missing = {n for n, p in params.items()
               if n not in filled and not _tied(model, n) and id(p) not in repacked}
    if missing:
        raise ModelLoadError(f"{ckpt.path.name} lacks {len(missing)} weights, e.g. "
                             f"{sorted(missing)[:3]}")
    return expanded


def _tied(model: DecoderModel, name: str) -> bool:
    return name == "lm_head.weight" \
        and getattr(model.lm_head, "weight", None) is getattr(model.embed_tokens, "weight", None)


def _expanded_summary(expanded: Counter) -> str:
    if not expanded:
        return "the rest read as floats"
    return "expanded to floats: " + ", ".join(f"{n} {k}" for k, n in sorted(expanded.items()))

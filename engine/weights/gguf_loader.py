"""Build our model from a GGUF file (--load-format gguf). Its Q4_0 / Q4_1 / Q8_0
projections become int4 / group-int8 layers holding the file's own integers and
scales (no float copy of them is ever made); every other tensor is de-quantized by
gguf into --dtype (F32/F16/BF16 exactly, K-quants and the rest expanded, logged).
--quantization none expands everything. The model's config and tokenizer come from
the directory's config.json and tokenizer files, as for safetensors."""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.platform.gguf_checkpoint import (FLOAT_TYPES, KEPT_QUANTIZED, GGUFCheckpoint,
                                                     find_gguf)
from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.models.registry import model_class
from kvserve.engine.models.quantized.int4 import PACK_ROWS, Int4Linear
from kvserve.engine.models.quantized.int8 import GroupInt8Linear
from kvserve.modelstore.errors import ModelLoadError

log = logging.getLogger("kvserve.loader")

GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}
# GGUF's per-layer name -> (our module under layers.i, shard of a packed module)
LAYER_NAMES = {
    "attn_norm": ("input_layernorm", None), "ffn_norm": ("post_attention_layernorm", None),
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2), "attn_output": ("self_attn.o_proj", None),
    "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", None),
}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def load_gguf_model(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype,
                    device: torch.device, max_positions: int,
                    quantization: str) -> LlamaForCausalLM:
    if quantization not in ("auto", "none"):
        raise ModelLoadError(f"--quantization {quantization} quantizes float weights at "
                             "load; a GGUF's weights are quantized already: use --quantization "
                             "auto to serve its blocks as they are, or none to expand them")
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise ModelLoadError("GGUF loading supports Llama layers without biases")
    if model_class(cfg) is not LlamaForCausalLM or cfg.sliding_window:
        raise ModelLoadError(f"GGUF files load for the Llama shape only (Llama, Mistral "
                             f"without a window, Qwen3); {cfg.architecture} loads from "
                             "safetensors")
    ckpt = GGUFCheckpoint(find_gguf(model_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions).to(dtype)  # no storage yet
    names = _our_names(ckpt, cfg.num_layers)
    kept: Counter = Counter()
    repacked: set[str] = set()
    if quantization == "auto":
        for i, layer in enumerate(model.layers):
            for proj in PROJECTIONS:
                sources = _sources(names, i, proj)
                kind = _repack(ckpt, layer, proj, sources, dtype, device)
                if kind is not None:
                    kept[kind] += 1
                    repacked.update(sources)
    _materialize(model, device)
    if cfg.tie_word_embeddings or "output.weight" not in ckpt.tensors:
        model.lm_head.weight = model.embed_tokens.weight  # as llama.cpp does without one
        names.pop("output.weight", None)
    expanded = _fill_floats(model, ckpt, {g: n for g, n in names.items() if g not in repacked})
    log.info("%s: %s projections kept quantized, %s", ckpt.path.name,
             dict(kept) or "no", _expanded_summary(expanded))
    return model.eval().requires_grad_(False)


def _our_names(ckpt: GGUFCheckpoint, num_layers: int) -> dict[str, tuple[str, int | None]]:
    """GGUF tensor name -> (our module or parameter name, shard)."""
    names: dict[str, tuple[str, int | None]] = {}
    for gguf_name in ckpt.tensors:
        if gguf_name in GLOBAL_NAMES:
            names[gguf_name] = (GLOBAL_NAMES[gguf_name], None)
            continue
        parts = gguf_name.split(".")  # blk.{i}.{name}.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_NAMES \
                or parts[3] != "weight" or not parts[1].isdigit() or int(parts[1]) >= num_layers:
            if "rope_freqs" in gguf_name:
                continue  # recomputed from the config
            raise ModelLoadError(f"{ckpt.path.name}: unexpected tensor {gguf_name!r}")
        module, shard = LAYER_NAMES[parts[2]]
        names[gguf_name] = (f"layers.{parts[1]}.{module}.weight", shard)
    return names


def _sources(names: dict, layer: int, proj: str) -> list[str]:
    """The GGUF tensors of one projection, in shard order."""
    target = f"layers.{layer}.{proj}.weight"
    found = sorted((shard or 0, g) for g, (ours, shard) in names.items() if ours == target)
    return [g for _, g in found]


def _repack(ckpt: GGUFCheckpoint, layer: nn.Module, proj: str, sources: list[str],
            dtype: torch.dtype, device: torch.device) -> str | None:
    """Replace `proj` with a quantized layer holding the file's blocks, when all of its
    tensors are one kept type; None leaves it to be expanded."""
    kinds = {KEPT_QUANTIZED.get(ckpt.type_name(s)) for s in sources}
    parent_name, _, attr = proj.rpartition(".")
    parent = layer.get_submodule(parent_name)
    expected = getattr(parent, attr).weight.shape
    if len(kinds) != 1 or None in kinds or not sources:
        return None
    kind = kinds.pop()
    if kind == "int4":
        if expected[0] % PACK_ROWS:
            return None  # not in the CPU kernel's row blocks: expand instead
        parts = [ckpt.int4_blocks(s) for s in sources]
        q, scales, mins = (torch.cat([p[j] for p in parts], dim=1 if j else 0) for j in range(3))
        new = Int4Linear(q, scales.to(device), mins.to(device), None, dtype)
    else:
        parts = [ckpt.int8_blocks(s) for s in sources]
        q = torch.cat([p[0] for p in parts]).to(device)
        new = GroupInt8Linear(q, torch.cat([p[1] for p in parts], dim=1).to(device), None,
                              dtype)
    if (new.out_features, new.in_features) != tuple(expected):
        raise ModelLoadError(f"{proj} from {sources} has shape "
                             f"{(new.out_features, new.in_features)}, expected {tuple(expected)}")
    setattr(parent, attr, new)
    return kind


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Storage on `device` for every tensor still on the meta device (the float
    ones); the quantized layers hold theirs already."""
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in tensors):
            module.to_empty(device=device, recurse=False)
    for rotary in model.rotaries():
        rotary.materialize(device)


def _fill_floats(model: LlamaForCausalLM, ckpt: GGUFCheckpoint, names: dict) -> Counter:
    """Copy the tensors `names` maps (those not repacked) into the model's float
    parameters; returns the counts of quantized types expanded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expanded: Counter = Counter()
    filled = set()
    for gguf_name, (ours, shard) in names.items():
        kind = ckpt.type_name(gguf_name)
        if kind not in FLOAT_TYPES:
            expanded[kind] += 1
        tensor = ckpt.float_tensor(gguf_name)
        if shard is not None:
            module_name, _, attr = ours.rpartition(".")
            model.get_submodule(module_name).load_shard(attr, shard, tensor)
        else:
            if params[ours].shape != tensor.shape:
                raise ModelLoadError(f"{gguf_name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(params[ours].shape)}")
            params[ours].data.copy_(tensor)
        filled.add(ours)
    missing = {n for n in params if n not in filled and not _tied(model, n)}
    if missing:
        raise ModelLoadError(f"{ckpt.path.name} lacks {len(missing)} weights, e.g. "
                             f"{sorted(missing)[:3]}")
    return expanded


def _tied(model: LlamaForCausalLM, name: str) -> bool:
    return name == "lm_head.weight" and model.lm_head.weight is model.embed_tokens.weight


def _expanded_summary(expanded: Counter) -> str:
    if not expanded:
        return "the rest read as floats"
    return "expanded to floats: " + ", ".join(f"{n} {k}" for k, n in sorted(expanded.items()))

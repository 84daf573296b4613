"""Build our model from a GGUF file (--load-format gguf) of a llama, qwen2 or qwen3
architecture. Its quantized projections
(Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants Q2_K..Q6_K, IQ4_NL/IQ4_XS, in any mix, as
Q4_K_M and Q5_K_M files have them) become int4 or group-int8 layers holding the
file's own integers and scales (no float copy of them is ever made); every other
tensor is de-quantized by gguf into --dtype (F32/F16/BF16 exactly, the rest
expanded, logged).
--quantization none expands everything. The model's config and tokenizer come from
the directory's config.json and tokenizer files, as for safetensors."""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.platform.gguf_checkpoint import FLOAT_TYPES, GGUFCheckpoint, find_gguf
from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.models.registry import model_class
from kvserve.engine.models.quantized.layer import QuantizedLinear
from kvserve.engine.weights.gguf_layers import keep_vocabulary, repack
from kvserve.engine.weights.quantization import resident_bytes
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
    "attn_q_norm": ("self_attn.q_norm", None), "attn_k_norm": ("self_attn.k_norm", None),
}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def load_gguf_model(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype,
                    device: torch.device, max_positions: int,
                    quantization: str) -> LlamaForCausalLM:
    if quantization not in ("auto", "none"):
        raise ModelLoadError(f"--quantization {quantization} quantizes float weights at "
                             "load; a GGUF's weights are quantized already: use --quantization "
                             "auto to serve its blocks as they are, or none to expand them")
    if cfg.o_bias or cfg.mlp_bias:
        raise ModelLoadError("GGUF loading supports biases on q/k/v only (Qwen2's)")
    if model_class(cfg) is not LlamaForCausalLM or cfg.sliding_window:
        raise ModelLoadError(f"GGUF files load for the Llama shape only (Llama, Mistral "
                             f"without a window, Qwen2, Qwen3); {cfg.architecture} loads "
                             "from safetensors")
    ckpt = GGUFCheckpoint(find_gguf(model_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions).to(dtype)  # no storage yet
    names = _our_names(ckpt, cfg.num_layers)
    tied = cfg.tie_word_embeddings or "output.weight" not in ckpt.tensors  # llama.cpp ties then
    if tied:
        names.pop("output.weight", None)
    kept: Counter = Counter()
    repacked: set[str] = set()
    if quantization == "auto":
        for i, layer in enumerate(model.layers):
            for proj in PROJECTIONS:
                sources, biases = _sources(names, i, proj), _sources(names, i, proj, "bias")
                kind = repack(ckpt, layer, proj, sources, biases, dtype, device)
                if kind is not None:
                    kept[kind] += 1
                    repacked.update(sources + biases)
        kept.update(keep_vocabulary(ckpt, model, names, tied, dtype, device))
    _materialize(model, device)
    if tied and hasattr(model.lm_head, "weight"):  # both float: one copy
        model.lm_head.weight = model.embed_tokens.weight
    expanded = _fill_floats(model, ckpt, {g: n for g, n in names.items() if g not in repacked})
    log.info("%s: %s tensors kept quantized, %s; %.1f MiB of weights resident for %.1f MiB "
             "in the file", ckpt.path.name, dict(kept) or "no", _expanded_summary(expanded),
             resident_bytes(model) / 2**20, ckpt.tensor_bytes() / 2**20)
    return model.eval().requires_grad_(False)


def _our_names(ckpt: GGUFCheckpoint, num_layers: int) -> dict[str, tuple[str, int | None]]:
    """GGUF tensor name -> (our module or parameter name, shard)."""
    names: dict[str, tuple[str, int | None]] = {}
    for gguf_name in ckpt.tensors:
        if gguf_name in GLOBAL_NAMES:
            names[gguf_name] = (GLOBAL_NAMES[gguf_name], None)
            continue
        parts = gguf_name.split(".")  # blk.{i}.{name}.weight (or .bias)
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_NAMES \
                or parts[3] not in ("weight", "bias") or not parts[1].isdigit() \
                or int(parts[1]) >= num_layers:
            if "rope_freqs" in gguf_name:
                continue  # recomputed from the config
            raise ModelLoadError(f"{ckpt.path.name}: unexpected tensor {gguf_name!r}")
        module, shard = LAYER_NAMES[parts[2]]
        names[gguf_name] = (f"layers.{parts[1]}.{module}.{parts[3]}", shard)
    return names


def _sources(names: dict, layer: int, proj: str, kind: str = "weight") -> list[str]:
    """The GGUF tensors of one projection's weight (or bias), in shard order."""
    target = f"layers.{layer}.{proj}.{kind}"
    found = sorted((shard or 0, g) for g, (ours, shard) in names.items() if ours == target)
    return [g for _, g in found]


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
    repacked = {id(p) for m in model.modules() if isinstance(m, QuantizedLinear)
                for p in m.parameters()}  # their biases came with their blocks
    missing = {n for n, p in params.items()
               if n not in filled and not _tied(model, n) and id(p) not in repacked}
    if missing:
        raise ModelLoadError(f"{ckpt.path.name} lacks {len(missing)} weights, e.g. "
                             f"{sorted(missing)[:3]}")
    return expanded


def _tied(model: LlamaForCausalLM, name: str) -> bool:
    return name == "lm_head.weight" \
        and getattr(model.lm_head, "weight", None) is getattr(model.embed_tokens, "weight", None)


def _expanded_summary(expanded: Counter) -> str:
    if not expanded:
        return "the rest read as floats"
    return "expanded to floats: " + ", ".join(f"{n} {k}" for k, n in sorted(expanded.items()))

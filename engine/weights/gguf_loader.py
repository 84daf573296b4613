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

import numpy as np
import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.platform.gguf_blocks import GroupQuant, concat_rows
from kvserve.engine.platform.gguf_checkpoint import (FLOAT_TYPES, KEPT_QUANTIZED, GGUFCheckpoint,
                                                     find_gguf)
from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.models.registry import model_class
from kvserve.engine.models.quantized.int4 import PACK_ROWS, Int4Linear
from kvserve.engine.models.quantized.int8 import GroupInt8Linear
from kvserve.engine.models.quantized.layer import QuantizedLinear
from kvserve.engine.models.quantized.stacked import StackedLinear
from kvserve.engine.models.quantized.table import QuantizedEmbedding, QuantizedTable
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
                kind = _repack(ckpt, layer, proj, sources, biases, dtype, device)
                if kind is not None:
                    kept[kind] += 1
                    repacked.update(sources + biases)
        kept.update(_keep_vocabulary(ckpt, model, names, tied, dtype, device))
    _materialize(model, device)
    if tied and hasattr(model.lm_head, "weight"):  # both float: one copy
        model.lm_head.weight = model.embed_tokens.weight
    expanded = _fill_floats(model, ckpt, {g: n for g, n in names.items() if g not in repacked})
    log.info("%s: %s tensors kept quantized, %s; %.1f MiB of weights resident for %.1f MiB "
             "in the file", ckpt.path.name, dict(kept) or "no", _expanded_summary(expanded),
             resident_bytes(model) / 2**20, ckpt.tensor_bytes() / 2**20)
    return model.eval().requires_grad_(False)


def _keep_vocabulary(ckpt: GGUFCheckpoint, model: LlamaForCausalLM, names: dict,
                     tied: bool, dtype: torch.dtype, device: torch.device) -> list[str]:
    """The LM head (the embedding table where tied) kept in its file's blocks where
    its quantized layer has a kernel here (torch's int4 one, bf16 on CPU): a head
    expanded every step costs more than its bytes save (the default model's Q8_0
    table expanded a step: 9 against 48 tokens/s), so elsewhere it is read as
    floats. The embedding table kept in its blocks too (a lookup expands only its
    rows), unless it is the float head's own weight (one copy). What is kept leaves
    `names` (the tensors read as floats); returns the kinds kept."""
    kinds = []
    embd = "token_embd.weight"
    source = embd if tied else "output.weight"
    head_kept = False
    if ckpt.type_name(source) in KEPT_QUANTIZED:
        head, kind = _quantized_layer(ckpt.group_quant(source), dtype, device)
        if getattr(head, "kernel_scales_zeros", None) is not None:
            model.lm_head = head
            kinds.append(f"head {kind}")
            names.pop("output.weight", None)
            head_kept = True
    if ckpt.type_name(embd) in KEPT_QUANTIZED and (head_kept or not tied):
        table = QuantizedTable(ckpt.group_quant(embd), dtype, device)
        model.embed_tokens = QuantizedEmbedding(table)
        kinds.append("table int4" if table.nibbles else "table int8")
        names.pop(embd)
    return kinds


def resident_bytes(model: nn.Module) -> int:
    """The bytes of the model's weights in memory, rope tables left out (each tensor
    counted once: a tied head is its table)."""
    tables = {id(t) for r in model.rotaries() for t in r.buffers()}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in tables}
    return sum(t.numel() * t.element_size() for t in tensors.values())


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


def _repack(ckpt: GGUFCheckpoint, layer: nn.Module, proj: str, sources: list[str],
            biases: list[str], dtype: torch.dtype, device: torch.device) -> str | None:
    """Replace `proj` with quantized layers holding the file's integers and scales
    when all of its tensors are of kept types (lossless either way): one layer where
    the shards share a type, else one per shard (StackedLinear); None leaves it to
    be expanded. Returns the kind of layer made."""
    if not sources or any(ckpt.type_name(s) not in KEPT_QUANTIZED for s in sources):
        return None
    parent_name, _, attr = proj.rpartition(".")
    parent = layer.get_submodule(parent_name)
    expected = tuple(getattr(parent, attr).weight.shape)
    parts = [ckpt.group_quant(s) for s in sources]
    found = (sum(p.q.shape[0] for p in parts), parts[0].q.shape[1])
    if found != expected or any(p.q.shape[1] != found[1] for p in parts):
        raise ModelLoadError(f"{proj} from {sources} has shape {found}, expected {expected}")
    bias = [ckpt.float_tensor(b).to(device) for b in biases] or [None] * len(parts)
    if len({ckpt.type_name(s) for s in sources}) > 1:
        shards = [_quantized_layer(p, dtype, device, b) for p, b in zip(parts, bias)]
        setattr(parent, attr, StackedLinear([m for m, _ in shards]))
        return "+".join(sorted({kind for _, kind in shards}))
    new, kind = _quantized_layer(concat_rows(parts), dtype, device,
                                 torch.cat(bias) if biases else None)
    setattr(parent, attr, new)
    return kind


def _quantized_layer(blocks: GroupQuant, dtype: torch.dtype, device: torch.device,
                     bias: torch.Tensor | None = None) -> tuple[nn.Module, str]:
    """int4 where the codes are 16 and the rows fill the CPU kernel's blocks, else
    a byte a weight."""
    def tensor(values: np.ndarray | None) -> torch.Tensor | None:  # [N, g] -> [g, N]
        return None if values is None else torch.from_numpy(
            np.ascontiguousarray(values.T)).to(device)

    if blocks.fits_int4() and blocks.q.shape[0] % PACK_ROWS == 0:
        blocks = blocks.shifted()
        codebook = None if blocks.codebook is None else torch.from_numpy(blocks.codebook)
        return Int4Linear(torch.from_numpy(blocks.q.astype(np.uint8)), tensor(blocks.scales),
                          tensor(blocks.mins), bias, dtype,
                          scale_base=tensor(blocks.scale_base),
                          min_base=tensor(blocks.min_base),
                          codebook=None if codebook is None else codebook.to(device)), "int4"
    q = blocks.q if blocks.codebook is None else blocks.codebook[blocks.q]  # int8 values
    return GroupInt8Linear(torch.from_numpy(q.astype(np.int8)).to(device),
                           tensor(blocks.scales), bias, dtype, tensor(blocks.mins),
                           scale_base=tensor(blocks.scale_base),
                           min_base=tensor(blocks.min_base)), "int8"


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

"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors)
read into our projections' terms, with every reason it cannot be served checked
first, so a bad adapter is one clear error and nothing already loaded is touched.

Each targeted projection of each layer becomes (A [r, in], B [out, r]) with the
adapter's scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) folded into B: the
served delta is x @ A.T @ B.T, what PEFT's merged weight W + scaling * B @ A gives."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The projections an adapter may target, as the checkpoints name them (a model has
# those of projection_shapes with outputs): Llama-family attention, latent attention's
# (kv_b_proj is not one: decode folds it into the queries and outputs), the MLP.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """The adapter cannot be served; the message says why (a 400 to the client)."""


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    # (layer, projection) -> (A [r, in], B [out, r] with the scaling folded in)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def targets(self) -> set[str]:
        return {module for _, module in self.weights}


def load_adapter(name: str, path: str | Path, max_rank: int, num_layers: int,
                 shapes: dict[str, tuple[int, int]], dtype: torch.dtype = torch.float32,
                 sparse_layers: frozenset[int] = frozenset()) -> LoRAAdapter:
    """shapes: projection -> (in features, out features) of the base model;
    sparse_layers: its mixture-of-experts layers (adapters reach their attention,
    not their experts)."""
    path = Path(path)
    config = _config(path)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"adapter {name!r}: `r` must be a positive integer")
    if rank > max_rank:
        raise LoRAAdapterError(f"adapter {name!r} has rank {rank}, above --max-lora-rank "
                               f"{max_rank}")
    tensors = _tensors(path)
    _refuse_unsupported(name, config, tensors)
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, which = _target(name, key, num_layers, sparse_layers, shapes)
        pairs.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {name!r}: layer {layer} {module} lacks its "
                                   f"lora_{'B' if 'A' in ab else 'A'} weight")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoRAAdapterError(
                f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, expected ({rank}, {fan_in}) and ({fan_out}, {rank}): "
                "an adapter for another base model?")
        weights[(layer, module)] = (a.to(dtype), (b.float() * scaling).to(dtype))
    if not weights:
        raise LoRAAdapterError(f"adapter {name!r} has no LoRA weights")
    return LoRAAdapter(name, path, rank, weights)


def _target(name: str, key: str, num_layers: int, sparse_layers: frozenset[int],
            shapes: dict[str, tuple[int, int]]) -> tuple[int, str, str]:
    """(layer, projection, "A" or "B") of the adapter's tensor `key`, checked against
    what the model has."""
    targets = [t for t in TARGETS if shapes[t][1]]  # this model's
    m = _WEIGHT.search(key)
    if m is None:
        raise LoRAAdapterError(f"adapter {name!r}: unexpected tensor {key!r} (only "
                               f"LoRA A/B weights of {', '.join(targets)})")
    layer, module, which = int(m[1]), m[2], m[3]
    if module not in targets:
        raise LoRAAdapterError(f"adapter {name!r} targets {module!r}; supported for this "
                               f"model: {', '.join(targets)}")
    if layer >= num_layers:
        raise LoRAAdapterError(f"adapter {name!r}: layer {layer} is past the model's "
                               f"{num_layers} layers")
    if layer in sparse_layers and module in MLP_TARGETS:
        raise LoRAAdapterError(f"adapter {name!r} targets {module!r} of layer {layer}, a "
                               "mixture-of-experts layer: LoRA reaches its attention only")
    return layer, module, which


def _config(path: Path) -> dict:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise LoRAAdapterError(f"{path} is not a PEFT adapter (no adapter_config.json)")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"cannot read {file}: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{path} is a {config.get('peft_type')} adapter; only LoRA "
                               "is supported")
    return config


def _refuse_unsupported(name: str, config: dict, keys) -> None:
    """PEFT options that change the product beyond x @ A.T @ B.T. keys: the
    adapter's tensors' names (per-module patterns that reach none of their modules
    are ignored, as PEFT ignores them: it writes some for other models' module
    names, such as a fused gate_up_proj)."""
    modules = {key.split(".lora_")[0] for key in keys}
    for option in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(option) or {}
        if not any(_reaches(p, m) for p in patterns for m in modules):
            config = {**config, option: None}
    problems = {
        "use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained layers)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    }
    for key, what in problems.items():
        if config.get(key):
            raise LoRAAdapterError(f"adapter {name!r} uses {what}, which is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"adapter {name!r} trains biases (bias="
                               f"{config['bias']!r}), which is not supported")


def _reaches(pattern, module: str) -> bool:
    """Whether a PEFT per-module pattern names the module: PEFT's own match, the
    pattern at the end of its dotted name. A pattern that is not a short regex
    (the adapter's config is the client's) counts as reaching it: refused."""
    if not isinstance(pattern, str) or len(pattern) > 256:
        return True
    try:
        return re.match(rf"(.*\.)?({pattern})$", module) is not None
    except re.error:
        return True


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAAdapterError(f"{path} has no adapter_model.safetensors")
    try:
        return load_file(str(file))
    except Exception as exc:  # a truncated or foreign file
        raise LoRAAdapterError(f"cannot read {file}: {exc}") from None


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """A ModelConfig's projections as (in features, out features); (0, 0) for those
    it does not have (TARGETS are every family's)."""
    h, i, mla = cfg.hidden_size, cfg.intermediate_size, cfg.mla
    shapes = dict.fromkeys(TARGETS, (0, 0)) | {
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    if mla is None:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return shapes | {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv),
                         "o_proj": (q, h)}
    q = cfg.num_heads * mla.qk_head_dim
    # q_proj's group reads x as q, k and v's does: their stacks, without outputs
    shapes |= {"kv_a_proj_with_mqa": (h, mla.cache_dim), "k_proj": (h, 0), "v_proj": (h, 0),
               "o_proj": (cfg.num_heads * mla.v_head_dim, h)}
    if mla.q_lora_rank:
        return shapes | {"q_a_proj": (h, mla.q_lora_rank), "q_b_proj": (mla.q_lora_rank, q)}
    return shapes | {"q_proj": (h, q)}

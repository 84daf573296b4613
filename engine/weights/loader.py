"""Build our model from a Hugging Face model directory.

Weights are read straight from `*.safetensors` (memory-mapped by safetensors) into
parameters created without data, so peak memory is one copy of the model. transformers
is not involved in the forward pass."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import nn

from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.models.decoder import DecoderModel
from kvserve.engine.models.pipeline_stage import WHOLE, PipelineStage, prune_to_stage
from kvserve.engine.models.registry import model_class
from kvserve.engine.models.tp_shard import SINGLE, TPShard
from kvserve.engine.platform.device import check_fits
from kvserve.modelstore.errors import ModelLoadError
from kvserve.modelstore.presets import resolve_model_path
from kvserve.modelstore.weight_bytes import weight_bytes

log = logging.getLogger("kvserve.loader")

@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int, shard: TPShard = SINGLE,
                stage: PipelineStage = WHOLE) -> DecoderModel:
    """Parameters are created on the meta device (no memory, no init work), then
    given uninitialised storage on `device`; `shard`: the tensor-parallel rank's part,
    `stage`: the pipeline stage's layers (the others get no storage)."""
    share = shard.size * (cfg.num_layers / stage.num_layers if not stage.whole else 1)
    check_fits(int(weight_bytes(cfg, dtype.itemsize) / share), device,
               "the model's weights")
    with _default_dtype(dtype), torch.device("meta"):
        model = model_class(cfg)(cfg, max_positions, shard)
    if not stage.whole:
        prune_to_stage(model, stage)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings and stage.last:  # to_empty may untie shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    for rotary in model.rotaries():
        rotary.materialize(device)
    return model.eval().requires_grad_(False)


def resolve_load_format(model: str | Path, load_format: str) -> str:
    """auto: gguf for a .gguf file or a directory whose weights are one .gguf file,
    else safetensors (a preset then asks for --load-format random)."""
    if load_format != "auto":
        return load_format
    try:
        path = resolve_model_path(model)
    except ValueError:
        return "safetensors"
    if path.suffix == ".gguf" or (path.is_dir() and not any(path.glob("*.safetensors"))
                                  and len(list(path.glob("*.gguf"))) == 1):
        return "gguf"
    return "safetensors"


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device, max_positions: int,
               load_format: str = "safetensors", seed: int = 0,
               quantization: str = "auto", shard: TPShard = SINGLE,
               stage: PipelineStage = WHOLE, panels_here: bool = False) -> DecoderModel:
    """`model_dir` may be `preset:NAME`; `random` never reads it (no checkpoint).
    A GGUF's quantized blocks are kept unless `quantization` is none; a float
    checkpoint is quantized afterwards (engine.quantization.quantize_model).
    shard: the tensor-parallel rank's part, the only part read (safetensors); stage:
    the pipeline stage's layers, the only ones read (safetensors only). panels_here:
    kvserve's CPU GEMM will pack quantized layers (a GGUF's quantized head is then
    kept where it fits the panels)."""
    load_format = resolve_load_format(model_dir, load_format)
    if load_format not in ("random", "safetensors", "gguf"):
        raise ModelLoadError(f"unknown load format {load_format!r}")
    if load_format == "gguf":
        from kvserve.engine.weights.gguf_loader import load_gguf_model

        if shard.size > 1 or not stage.whole:
            raise ModelLoadError("tensor and pipeline parallelism read safetensors "
                                 "checkpoints, not GGUF files")
        return load_gguf_model(resolve_model_path(model_dir), cfg, dtype, device,
                               max_positions, quantization, panels_here)
    if load_format == "random" and not stage.whole:
        raise ModelLoadError("pipeline stages load a checkpoint (random weights would "
                             "differ from stage to stage's draws)")
    model = build_model(cfg, dtype, device, max_positions, shard, stage)
    if load_format == "random":
        init_random(model, seed)
    else:
        load_safetensors(model, resolve_model_path(model_dir), shard)
    return model


def init_random(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """In place, on the parameters' own device and dtype: no float32 or host copy of
    the model is ever made (an 8B model is 16 GB in bf16, 32 GB in fp32). A seed gives
    the same float32 CPU weights as `torch.randn(...) * std`; other dtypes and CUDA
    draw their own streams."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            continue  # no storage to fill
        if name.endswith("norm.weight"):  # the identity: 1, or 0 where it scales by 1 + w
            norm = model.get_submodule(name.rpartition(".")[0])
            p.data.fill_(1.0 - getattr(norm, "weight_offset", 0.0))
            continue
        if p.device not in gens:
            gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.data.normal_(0.0, std, generator=gens[p.device])


def load_safetensors(model: DecoderModel, model_dir: Path,
                     shard: TPShard = SINGLE) -> None:
    """Each tensor read once, memory-mapped, and only the rows or columns `shard`
    holds (a tensor-parallel rank never reads the whole model)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir} (for random "
                             "weights of this shape, use --load-format random)")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[tuple[str, int | None]] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                for name, tensor in model.checkpoint_tensors(key, f.get_slice(key)):
                    if _load_one(model, params, name, tensor, shard):
                        loaded.add(model.checkpoint_name(name))
    missing = _expected_weights(model, params) - loaded
    if missing:
        raise ModelLoadError(f"checkpoint in {model_dir} lacks {len(missing)} weights, "
                             f"e.g. {sorted(missing)[:3]}")


def _load_one(model, params: dict, ckpt_name: str, tensor, tp: TPShard = SINGLE) -> bool:
    """tensor: the checkpoint's (a tensor, or a safetensors slice read where indexed)."""
    name, shard = model.checkpoint_name(ckpt_name)
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return False  # tied: the embedding is the head
    if name not in params:
        if "rotary_emb" in name or name.startswith(model.absent_prefixes):
            return False  # (or another pipeline stage's)
        raise ModelLoadError(f"unexpected weight {ckpt_name!r} in checkpoint")
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if shard is not None and not getattr(module, "holds", lambda _: True)(shard):
        return False  # another rank's expert
    tensor = tp.checkpoint_slice(model.config, name, shard, tensor, module)
    if shard is not None:
        module.load_shard(attr, shard, tensor)
    else:
        param = params[name]
        if param.shape != tensor.shape:
            raise ModelLoadError(f"weight {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
        param.data.copy_(tensor)
    return True


def _expected_weights(model, params: dict) -> set[tuple[str, int | None]]:
    """Every (parameter, shard) a complete checkpoint fills, in our naming."""
    expected = set()
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        shards = getattr(module, "shard_sizes", None)
        if hasattr(module, "expected_shards"):  # stacked experts
            expected.update((name, s) for s in module.expected_shards(attr))
        elif shards:
            expected.update((name, i) for i in range(len(shards)))
        else:
            expected.add((name, None))
    return expected

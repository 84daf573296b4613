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

from kvserve.engine.model_config import ModelConfig
from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.parallel.shard import SINGLE, TPShard
from kvserve.modelstore.errors import ModelLoadError
from kvserve.modelstore.presets import resolve_model_path
from kvserve.modelstore.weight_bytes import weight_bytes

log = logging.getLogger("kvserve.loader")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda requested but CUDA is not available")
    return torch.device(device)


# CPU flags of native bf16 arithmetic (x86: AVX512-BF16, AMX; Arm: the BF16 extension).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty if unknown."""
    try:
        text = open(cpuinfo, encoding="ascii", errors="replace").read()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def resolve_dtype(dtype: str, device: torch.device, flags: set[str] | None = None
                  ) -> torch.dtype:
    """auto = bfloat16 on CUDA; on CPU bfloat16 only where the CPU computes it
    natively, float32 elsewhere. Measured (bench/results/cpu_profile_*.md): with
    AVX512-BF16 bf16 decodes ~2x faster than float32 (half the bytes); with AVX2
    alone it is 2.4-3.6x slower (every product converted in software)."""
    if dtype == "auto" and device.type != "cpu":
        return torch.bfloat16
    if dtype == "auto":
        native = sorted(set(NATIVE_BF16_FLAGS) & (cpu_flags() if flags is None else flags))
        log.info("--dtype auto on CPU: %s", f"bfloat16 (native: {', '.join(native)})"
                 if native else "float32 (this CPU has no native bf16)")
        return torch.bfloat16 if native else torch.float32
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new allocations on `device`, or None when unknown (or when
    nothing is allocated: the meta device, used to count parameters)."""
    if device.type == "meta":
        return None
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(needed: int, device: torch.device, what: str) -> None:
    free = available_memory(device)
    if free is not None and needed > free:
        raise ModelLoadError(
            f"{what} needs {needed / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is "
            f"available on {device}; use a smaller model, --dtype bfloat16, or a smaller KV cache")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int, shard: TPShard = SINGLE) -> LlamaForCausalLM:
    """Parameters are created on the meta device (no memory, no init work), then
    given uninitialised storage on `device`; `shard`: the tensor-parallel rank's part."""
    check_fits(int(weight_bytes(cfg, dtype.itemsize)) // shard.size, device,
               "the model's weights")
    with _default_dtype(dtype), torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, shard)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty may untie shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.materialize(device)
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
               quantization: str = "auto", shard: TPShard = SINGLE) -> LlamaForCausalLM:
    """`model_dir` may be `preset:NAME`; `random` never reads it (no checkpoint).
    A GGUF's quantized blocks are kept unless `quantization` is none; a float
    checkpoint is quantized afterwards (engine.quantization.quantize_model).
    shard: the tensor-parallel rank's part, the only part read (safetensors)."""
    load_format = resolve_load_format(model_dir, load_format)
    if load_format not in ("random", "safetensors", "gguf"):
        raise ModelLoadError(f"unknown load format {load_format!r}")
    if load_format == "gguf":
        from kvserve.engine.gguf_loader import load_gguf_model

        if shard.size > 1:
            raise ModelLoadError("tensor parallelism reads safetensors checkpoints, "
                                 "not GGUF files")
        return load_gguf_model(resolve_model_path(model_dir), cfg, dtype, device,
                               max_positions, quantization)
    model = build_model(cfg, dtype, device, max_positions, shard)
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
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        if p.device not in gens:
            gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.data.normal_(0.0, std, generator=gens[p.device])


def load_safetensors(model: LlamaForCausalLM, model_dir: Path,
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
            for name in f.keys():
                if _load_one(model, params, name, f.get_slice(name), shard):
                    loaded.add(_our_name(name))
    missing = _expected_weights(model, params) - loaded
    if missing:
        raise ModelLoadError(f"checkpoint in {model_dir} lacks {len(missing)} weights, "
                             f"e.g. {sorted(missing)[:3]}")


def _our_name(ckpt_name: str) -> tuple[str, int | None]:
    """Checkpoint name -> (our parameter name, shard index within a packed layer)."""
    name = ckpt_name.removeprefix("model.")
    for frag, (packed, shard) in LlamaForCausalLM.packed_modules.items():
        if f".{frag}." in name:
            return name.replace(f".{frag}.", f".{packed}."), shard
    return name, None


def _load_one(model, params: dict, ckpt_name: str, tensor, tp: TPShard = SINGLE) -> bool:
    """tensor: the checkpoint's (a tensor, or a safetensors slice read where indexed)."""
    name, shard = _our_name(ckpt_name)
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return False  # tied: the embedding is the head
    if name not in params:
        if "rotary_emb" in name:
            return False
        raise ModelLoadError(f"unexpected weight {ckpt_name!r} in checkpoint")
    tensor = tp.checkpoint_slice(model.config, name, shard, tensor)
    if shard is not None:
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name).load_shard(attr, shard, tensor)
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
        if shards:
            expected.update((name, i) for i in range(len(shards)))
        else:
            expected.add((name, None))
    return expected

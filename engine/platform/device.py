"""Where the engine runs and in what: the device (--device), the dtype (--dtype,
with bfloat16 on a CPU only where it computes it natively), the CPU's feature flags,
and the memory left for new allocations."""
from __future__ import annotations

import logging

import torch

from kvserve.modelstore.errors import ModelLoadError

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

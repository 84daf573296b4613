"""Picks the attention backend for `--attention-backend`.

auto: our Triton kernels on CUDA, the torch reference elsewhere. flash-attn is used
only when asked for, and then must be importable; Triton on a CPU runs only through
Triton's interpreter (TRITON_INTERPRET=1, for tests)."""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from kvserve.engine.kernels.attention.backend import AttentionBackend

log = logging.getLogger("kvserve.attention")

BACKEND_NAMES = ("auto", "triton", "flash-attn", "torch")
# flash-attn 2 reads a paged cache only in pages of a multiple of 256 tokens.
FLASH_ATTN_PAGE_MULTIPLE = 256


class AttentionBackendError(ValueError):
    """The requested attention backend cannot run here."""


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in BACKEND_NAMES:
        raise AttentionBackendError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name != "auto":
        return name
    if device.type == "cuda":
        if _importable("triton"):
            return "triton"
        log.warning("triton is not installed: using the torch attention backend on CUDA")
    return "torch"


def make_backend(name: str, device: torch.device, block_size: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """kv_dtype: the cache's, when it is not the model's (an fp8 cache)."""
    name = resolve_backend_name(name, device)
    fp8_cache = kv_dtype is not None and kv_dtype.itemsize == 1
    if name == "triton":
        _check_triton(device, fp8_cache)
        from kvserve.engine.kernels.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "flash-attn":
        if fp8_cache:
            raise AttentionBackendError(
                "flash-attn 2 reads no fp8 KV cache; use --attention-backend triton, or "
                "--kv-cache-dtype auto")
        _check_flash_attn(device, block_size, dtype)
        from kvserve.engine.kernels.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    from kvserve.engine.kernels.attention.torch_backend import TorchBackend

    return TorchBackend()


def _check_triton(device: torch.device, fp8_cache: bool) -> None:
    if not _importable("triton"):
        raise AttentionBackendError(
            "the triton attention backend needs the triton package (pip install triton)")
    if device.type != "cuda" and not triton_interpreting():
        raise AttentionBackendError(
            f"the triton attention backend runs on CUDA, not {device.type} (set "
            "TRITON_INTERPRET=1 to run it, slowly, through Triton's interpreter)")
    if fp8_cache and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        # Triton converts to and from e4m3 only on Ada/Hopper and later.
        raise AttentionBackendError(
            "an fp8 KV cache through the triton backend needs a GPU of compute capability "
            "8.9 or newer (Ada, Hopper); use --kv-cache-dtype auto, or --attention-backend "
            "torch")


def _check_flash_attn(device: torch.device, block_size: int, dtype: torch.dtype) -> None:
    if not _importable("flash_attn"):
        raise AttentionBackendError(
            "the flash-attn attention backend needs the flash_attn package "
            "(pip install 'kvserve[flash-attn]'); use --attention-backend triton or auto")
    if device.type != "cuda":
        raise AttentionBackendError(f"flash-attn runs on CUDA, not {device.type}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise AttentionBackendError(f"flash-attn computes in float16 or bfloat16, not {dtype}")
    if block_size % FLASH_ATTN_PAGE_MULTIPLE:
        raise AttentionBackendError(
            f"flash-attn reads the paged KV cache in blocks of a multiple of "
            f"{FLASH_ATTN_PAGE_MULTIPLE} tokens; --block-size is {block_size}")


def check_layers_fit(name: str, *, sinks: bool, latent: bool) -> None:
    """Refuses a backend that lacks what a model's layers need: attention sinks
    (gpt-oss) or latent attention (DeepSeek)."""
    if name != "flash-attn":
        return
    if sinks:
        raise AttentionBackendError("flash-attn 2 has no attention sinks, which this model's "
                                    "layers have (gpt-oss): use --attention-backend triton")
    if latent:
        raise AttentionBackendError("flash-attn 2 has no latent-attention path (DeepSeek's "
                                    "cache rows of latent + rotary values are wider than "
                                    "its 256-wide heads): use --attention-backend triton")

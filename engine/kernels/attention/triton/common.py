"""Helpers shared by the kernel wrappers: tile sizes, dtype handling, device facts."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_JIT: tl.constexpr = tl.constexpr(LOG2E)  # the same, for use inside kernels
# On the GPU tl.dot needs at least 16 in every dimension (the interpreter accepts
# less, so a smaller tile would pass the CPU tests and fail on the device).
MIN_DOT_DIM = 16


def dot_tile(n: int) -> int:
    """A tile covering n along a tl.dot dimension: a power of two, at least 16."""
    return max(MIN_DOT_DIM, triton.next_power_of_2(n))


def upcast_on_load(t: torch.Tensor) -> bool:
    """Whether kernels convert loaded K/V/Q to fp32 at once. Triton's CPU interpreter
    keeps bf16 as raw 16-bit integers and computes garbage with them, so it must; on
    the GPU bf16/fp16 stay native so tl.dot runs on tensor cores."""
    return t.device.type != "cuda"


def cache_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The kernels' (k_scale, v_scale, KV_FP8) arguments: an fp8 cache's scales, or,
    for a cache in the model dtype, the cache itself in their place (never read:
    KV_FP8 is a compile-time False)."""
    if k_scale is None:
        return k_cache, k_cache, False
    return k_scale, v_scale, True


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models get products as accurate as fp32's (the torch reference's) rather
    than tf32's: three tf32 products on the tensor cores ("tf32x3"), not "ieee" on the
    FMA units, whose operands in registers spilled at head_dim 64-128 on sm_90
    (bench/results/triton_aot_*). 16-bit dots are exact on the tensor cores anyway."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def parallelism(device: torch.device) -> int:
    """Programs the device runs at once, roughly: its SM count on CUDA. The
    interpreter runs programs one by one, so it gets 1 (fewest splits)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_head_layout(*tensors: torch.Tensor) -> None:
    """Kernels index [rows, heads, head_dim] by the first two strides only."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("attention kernels need a contiguous last dim, "
                             f"got strides {t.stride()}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """[num_blocks, block_size, kv_heads, head_dim], contiguous, both alike."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape == v_cache.shape and k_cache.dim() == 4):
        raise ValueError("the KV cache must be two contiguous [blocks, block_size, "
                         "kv_heads, head_dim] tensors of one shape")

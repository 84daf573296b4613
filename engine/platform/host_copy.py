"""Host values onto the device without making the host wait for the device.

A copy from ordinary (pageable) host memory may wait for the device's stream to
drain, that is for everything launched before it: the whole forward pass of the
step just launched. Under async scheduling that would put the host back on the
critical path. So on CUDA the values go through pinned memory (from torch's caching
host allocator, cheap after the first steps) with a non-blocking copy."""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` (a list, possibly nested) on `device`."""
    return host_tensor_to(torch.tensor(values, dtype=dtype), device)


def host_tensor_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` (itself on CPU)."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)

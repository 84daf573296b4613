"""Random paged-attention batches for the kernel tests: a KV cache whose blocks are
scattered at random, each request's cached prefix in place, the step's new tokens,
and the step's common metadata (decodes first), built by the runner's own builder.
Every cache slot no request owns holds a poison value, so a kernel that reads
outside a request's context gives NaN."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from kvserve.engine.kernels.attention import AttentionMetadata
from kvserve.engine.kernels.attention.step_metadata import build_host_step, context_slots

# Interpreted on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 unless told
# otherwise); with TRITON_INTERPRET=0 on a GPU host the same tests run on the GPU.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
needs_kernel_device = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="Triton kernels need TRITON_INTERPRET=1 or a CUDA device")


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] the new tokens' keys
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]: prefixes only
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def with_new_tokens_cached(self) -> "PagedBatch":
        """A copy whose cache also holds this step's K/V (for attention-only kernels)."""
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        hd = kc.shape[-2:]
        kc.view(-1, *hd)[self.meta.slot_mapping] = self.k
        vc.view(-1, *hd)[self.meta.slot_mapping] = self.v
        return PagedBatch(self.q, self.k, self.v, kc, vc, self.meta, self.scale)


def make_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, kv_heads: int,
               head_dim: int, block_size: int, dtype=torch.float32, seed: int = 0,
               device: str = DEVICE, poison: float = float("nan")) -> PagedBatch:
    """Request i computes q_lens[i] new tokens at the end of a seq_lens[i] context;
    decodes (q_len 1) must come first."""
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_req) + 3  # spare blocks stay poisoned
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[sum(per_req[:i]):sum(per_req[:i + 1])] for i in range(len(per_req))]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, poison, dtype=dtype)
    v_cache = torch.full(shape, poison, dtype=dtype)
    for table, s, n in zip(tables, seq_lens, q_lens):
        slots = context_slots(torch.tensor(table), torch.arange(s - n), block_size)
        for cache in (k_cache, v_cache):
            prefix = _randn(g, (s - n, kv_heads, head_dim), dtype)
            cache.view(-1, kv_heads, head_dim)[slots] = prefix
    total = sum(q_lens)
    starts = [s - n for s, n in zip(seq_lens, q_lens)]
    host = build_host_step(starts, q_lens, tables, block_size)
    dev = torch.device(device)
    _, meta, _ = host.to_device(dev)
    q = _randn(g, (total, num_heads, head_dim), dtype)
    k = _randn(g, (total, kv_heads, head_dim), dtype)
    v = _randn(g, (total, kv_heads, head_dim), dtype)
    return PagedBatch(q.to(dev), k.to(dev), v.to(dev), k_cache.to(dev), v_cache.to(dev),
                      meta, head_dim ** -0.5)


def _randn(g: torch.Generator, shape, dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def reference(batch: PagedBatch) -> torch.Tensor:
    """The torch backend's output in fp32 from the same (upcast) inputs, store
    included; the batch itself is left as it was."""
    from kvserve.engine.kernels.attention.torch_backend import TorchBackend

    b, backend = batch, TorchBackend()
    caches = (b.k_cache.float().clone(), b.v_cache.float().clone())
    return backend.forward(b.q.float(), b.k.float(), b.v.float(), *caches,
                           backend.prepare(b.meta), b.scale)

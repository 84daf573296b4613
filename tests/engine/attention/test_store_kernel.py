"""The Triton K/V store against the torch one: exact, padded tokens (slot -1)
skipped, every other slot untouched."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.attention.triton import store_kv_cache
from tests.engine.attention.paged_batch import DEVICE, needs_kernel_device

pytestmark = needs_kernel_device

SENTINEL = 7.25  # exact in bf16; a slot that should not change must still hold it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim,block_size",
                         [(1, 64, 16), (8, 128, 32), (2, 24, 16)])
def test_store_writes_slots_and_skips_padding(dtype, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(kv_heads * head_dim)
    num_tokens, num_blocks = 40, 6
    # k and v as the model has them: views into one packed qkv projection.
    qkv = torch.randn(num_tokens, (4 + 2) * kv_heads * head_dim, generator=g).to(DEVICE, dtype)
    kv_size = kv_heads * head_dim
    _, k, v = qkv.split([4 * kv_size, kv_size, kv_size], -1)
    k, v = (x.reshape(num_tokens, kv_heads, head_dim) for x in (k, v))
    assert not k.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    slots[::7] = -1  # padded tokens
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # Each cache sits between two guard blocks: a write to slot -1 would land in one.
    guarded = [torch.full((num_blocks + 2, *shape[1:]), SENTINEL, dtype=dtype, device=DEVICE)
               for _ in "kv"]
    k_cache, v_cache = (g[1:-1] for g in guarded)
    store_kv_cache(k, v, k_cache, v_cache, slots)
    keep = slots >= 0
    for buf, new in zip(guarded, (k, v)):
        expected = torch.full_like(buf, SENTINEL)
        expected[1:-1].view(-1, kv_heads, head_dim)[slots[keep]] = new[keep]
        assert torch.equal(buf, expected)


def test_store_of_no_tokens_is_a_no_op():
    cache = torch.zeros(2, 16, 1, 64, device=DEVICE)
    empty = torch.empty(0, 1, 64, device=DEVICE)
    no_slots = torch.empty(0, dtype=torch.long, device=DEVICE)
    store_kv_cache(empty, empty, cache, cache.clone(), no_slots)
    assert not cache.any()

"""Where a peer's blocks lie and how they are packed here (engine/kv_transfer/
block_layout.py), without a transfer engine: the ranges block_reads names, copied
with memmove, give exactly the bytes the second tier packs for each block, with a
run of consecutive blocks one range per cache tensor."""
from __future__ import annotations

import ctypes

import torch

from kvserve.engine.kv_offload.host_tier import HostKVTier, cache_tensors
from kvserve.engine.kv_transfer import block_layout


def caches(num_blocks: int = 12):
    torch.manual_seed(0)
    k0, v0 = torch.randn(num_blocks, 16, 2, 8), torch.randn(num_blocks, 16, 2, 8)
    latent = torch.randn(num_blocks, 16, 24, dtype=torch.bfloat16)  # K and V one tensor
    return [(k0, v0), (latent, latent)]


def test_reads_land_as_the_tier_packs_blocks():
    kv = caches()
    tensors = cache_tensors(kv)
    peer = block_layout.regions(tensors)
    tier = HostKVTier(kv, 1 << 20)
    block_ids = [5, 6, 7, 2, 9, 10, 11]
    packed = torch.zeros(len(block_ids) * tier.block_bytes, dtype=torch.uint8)
    local, remote, lengths = block_layout.block_reads(peer, block_ids, packed.data_ptr())
    # three runs (5-7, 2, 9-11) per tensor, three tensors
    assert len(lengths) == 9
    for dst, src, n in zip(local, remote, lengths):
        ctypes.memmove(dst, src, n)
    blocks = block_layout.to_block_major(packed, peer, len(block_ids))
    for j, block_id in enumerate(block_ids):
        want = tier._gather(block_id)
        assert torch.equal(blocks[j * tier.block_bytes:(j + 1) * tier.block_bytes], want)


def test_the_fingerprint_tells_layouts_apart():
    tensors = cache_tensors(caches())
    same = block_layout.fingerprint(cache_tensors(caches()), 16)
    assert block_layout.fingerprint(tensors, 16) == same
    assert block_layout.fingerprint(tensors, 32) != same
    assert block_layout.fingerprint([t.half() for t in tensors], 16) != same
    # several layers in one storage are registered once
    big = torch.zeros(4, 12, 16, 8)
    views = [big[i] for i in range(4)]
    assert len(block_layout.storages(views)) == 1

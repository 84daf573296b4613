"""The absorbed latent-attention kernels (triton/latent_absorbed.py) against the
torch reference's multi-query attention over the same cache rows, keys and values
alike (the layer keeps the latent part): decodes in one split and many, heads in
one program and over several (with a partial last one), prompt chunks fresh and
after a cached prefix, fp32 and bf16, DeepSeek's 512 + 64 widths and odd ones."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.attention.triton.latent_absorbed import (latent_decode,
                                                                      latent_prefill)
from tests.engine.attention.paged_batch import PagedBatch, make_batch, needs_kernel_device
from tests.engine.attention.paged_batch import reference as mqa_reference
from tests.engine.attention.tolerances import assert_close

pytestmark = needs_kernel_device


def latent_batch(q_lens, seq_lens, heads, latent, rotary, block_size, dtype, seed):
    """A step whose cache rows (new ones included) are [c, k_rot]: K and V alike."""
    b = make_batch(q_lens, seq_lens, heads, 1, latent + rotary, block_size, dtype, seed=seed)
    return PagedBatch(b.q, b.k, b.k, b.k_cache, b.k_cache, b.meta, b.scale)


def reference(b: PagedBatch, latent: int) -> torch.Tensor:
    return mqa_reference(b)[..., :latent]


def cached(b: PagedBatch) -> torch.Tensor:
    cache = b.k_cache.clone()
    cache.view(-1, cache.shape[-1])[b.meta.slot_mapping] = b.k[:, 0]
    return cache


# (seq_lens, heads, latent, rotary, block size, dtype, splits or None for the plan)
DECODES = {
    "one-split": ([1, 40, 300], 4, 32, 8, 16, torch.float32, None),
    "many-splits-two-head-programs": ([2000, 17, 700], 20, 64, 16, 16, torch.float32, 8),
    "deepseek-widths-bf16": ([600, 5], 16, 512, 64, 32, torch.bfloat16, 3),
}


@pytest.mark.parametrize("case", DECODES)
def test_latent_decode_matches_reference(case):
    seq_lens, heads, latent, rotary, bs, dtype, splits = DECODES[case]
    b = latent_batch([1] * len(seq_lens), seq_lens, heads, latent, rotary, bs, dtype,
                     seed=len(case))
    m = b.meta
    out = torch.full_like(b.q, float("nan"))
    latent_decode(b.q, cached(b), out, m.seq_lens, m.block_tables, b.scale, latent,
                  m.max_seq_len, num_splits=splits, min_partition=64)
    assert_close(out[..., :latent], reference(b, latent))
    assert out[..., latent:].isnan().all()  # the rotary part left as it was


# (q_lens, seq_lens, heads, latent, rotary, block size, dtype)
PREFILLS = {
    "fresh-and-after-prefix": ([1, 7, 40, 3], [50, 7, 100, 3], 4, 32, 8, 16, torch.float32),
    "heads-over-two-programs": ([19, 5], [19, 260], 20, 64, 16, 16, torch.float32),
    "deepseek-widths-bf16": ([12, 33], [12, 90], 16, 512, 64, 32, torch.bfloat16),
}


@pytest.mark.parametrize("case", PREFILLS)
def test_latent_prefill_matches_reference(case):
    q_lens, seq_lens, heads, latent, rotary, bs, dtype = PREFILLS[case]
    b = latent_batch(q_lens, seq_lens, heads, latent, rotary, bs, dtype, seed=len(case))
    m = b.meta
    out = torch.full_like(b.q, float("nan"))
    first = 1 if q_lens[0] == 1 else 0  # a leading decode is someone else's row
    latent_prefill(b.q, cached(b), out, m.query_start_loc, m.seq_lens, m.block_tables,
                   b.scale, latent, first, len(q_lens) - first, max(q_lens[first:]))
    rows = slice(q_lens[0] if first else 0, None)
    assert_close(out[rows, :, :latent], reference(b, latent)[rows])
    assert out[:rows.start].isnan().all() and out[..., latent:].isnan().all()

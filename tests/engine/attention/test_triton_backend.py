"""The Triton backend (store, then decode and prefill kernels) against the torch
backend on whole steps: mixed batches of decodes, prefix-hit chunks and fresh
prompts, with padded tokens (slot -1) that neither backend may store."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.engine.kernels.attention.torch_backend import TorchBackend
from kvserve.engine.kernels.attention.triton_backend import TritonBackend
from tests.engine.attention.paged_batch import PagedBatch, make_batch, needs_kernel_device
from tests.engine.attention.tolerances import assert_close

pytestmark = needs_kernel_device

PAD = 3  # padded tokens after the real ones


def with_padding(b: PagedBatch) -> PagedBatch:
    """The batch plus PAD tokens that belong to no request and have slot -1, as a
    runner padding a batch to a fixed size would make."""
    def grow(t):
        return torch.cat([t, torch.randn(PAD, *t.shape[1:]).to(t)])
    pad_slots = torch.full((PAD,), -1, dtype=torch.long, device=b.q.device)
    slots = torch.cat([b.meta.slot_mapping, pad_slots])
    meta = dataclasses.replace(b.meta, slot_mapping=slots, num_tokens=b.meta.num_tokens + PAD)
    return PagedBatch(grow(b.q), grow(b.k), grow(b.v), b.k_cache, b.v_cache, meta, b.scale)


def run(backend, b: PagedBatch):
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    out = backend.forward(b.q, b.k, b.v, k_cache, v_cache, backend.prepare(b.meta), b.scale)
    return out, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_of_eight_matches_torch_backend(dtype):
    # 3 decodes, 2 prefix-hit chunks, 1 chunk starting mid-block, 2 fresh prompts.
    q_lens = [1, 1, 1, 40, 7, 19, 100, 3]
    seq_lens = [300, 2, 129, 90, 64, 51, 100, 3]
    b = with_padding(make_batch(q_lens, seq_lens, 8, 2, 64, 16, dtype, seed=5))
    out, k_cache, v_cache = run(TritonBackend(), b)
    ref, ref_k, ref_v = run(TorchBackend(), b)
    real = b.meta.num_tokens - PAD
    assert_close(out[:real], ref[:real])
    # The store is a copy: both backends leave identical caches, poison included,
    # so the padded tokens were written nowhere.
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


def test_decode_only_and_prefill_only_steps():
    for q_lens, seq_lens in (([1, 1, 1], [17, 1, 600]), ([12, 30], [12, 45])):
        b = make_batch(q_lens, seq_lens, 4, 1, 128, 32, seed=len(q_lens))
        out, *_ = run(TritonBackend(), b)
        ref, *_ = run(TorchBackend(), b)
        assert_close(out, ref)

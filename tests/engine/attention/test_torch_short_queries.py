"""The torch backend's batched path for short queries (speculative verifications,
tiny prompts: one padded attention call for all of them) against its per-request
path, on mixed steps whose unowned cache slots are poisoned with NaN."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.attention import torch_backend
from kvserve.engine.kernels.attention.torch_backend import TorchBackend
from tests.engine.attention.paged_batch import make_batch


def run(b):
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    backend = TorchBackend()
    out = backend.forward(b.q, b.k, b.v, k_cache, v_cache, backend.prepare(b.meta), b.scale)
    return out, k_cache, v_cache


@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1, 1, 5, 5, 2, 40, 3], [30, 1, 70, 5, 17, 90, 3]),  # decodes, verifications, prompts
    ([4, 16, 17], [4, 200, 60]),  # the threshold: 16 batched, 17 alone
    ([9], [9]),  # a fresh short prompt alone: plain causal
])
def test_batched_short_queries_match_the_per_request_path(monkeypatch, q_lens, seq_lens):
    b = make_batch(q_lens, seq_lens, 6, 2, 32, 16, seed=len(q_lens), device="cpu")
    out, k_cache, v_cache = run(b)
    assert torch.isfinite(out).all()  # nothing read outside a request's own slots
    monkeypatch.setattr(torch_backend, "SHORT_QUERY", 0)  # every request on its own
    assert TorchBackend().prepare(b.meta).short is None
    ref, ref_k, ref_v = run(b)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)

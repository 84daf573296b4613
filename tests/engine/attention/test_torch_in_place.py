"""The torch backend reading K/V in place (in_place=True, what compiled CPU steps use):
decodes through cpu_paged.py, prompt chunks through kvserve::paged_prefill where the
kernels are loaded. The same output as the gathering reference on a mixed batch whose
unowned cache slots are poisoned (NaN), in float32 and bf16."""
import pytest
import torch

from kvserve.engine.kernels.attention.torch_backend import TorchBackend
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import NEEDED_FLAGS, load_once
from tests.engine.attention.paged_batch import make_batch

pytestmark = pytest.mark.skipif(not set(NEEDED_FLAGS) <= cpu_flags(),
                                reason="kvserve's CPU kernels need AVX2, FMA and F16C")


def run(backend, b):
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    out = backend.forward(b.q, b.k, b.v, k_cache, v_cache, backend.prepare(b.meta), b.scale)
    return out, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_matches_the_gathering_reference(dtype, monkeypatch):
    load_once()
    calls = []
    real = torch.ops.kvserve.paged_prefill
    monkeypatch.setattr(torch.ops.kvserve, "paged_prefill",
                        lambda *a: calls.append((a[0].shape[0], a[4])) or real(*a),
                        raising=False)
    # 3 decodes, 2 chunks after cached prefixes, one starting mid-block, 2 fresh prompts
    # (the last one short: it takes the padded short-query path in both).
    q_lens = [1, 1, 1, 40, 17, 19, 100, 3]
    seq_lens = [300, 2, 129, 90, 64, 51, 100, 3]
    b = make_batch(q_lens, seq_lens, 9, 3, 64, 16, dtype, seed=7, device="cpu")
    out, k_cache, v_cache = run(TorchBackend(in_place=True), b)
    ref, ref_k, ref_v = run(TorchBackend(), b)
    assert calls == [(40, 90), (17, 64), (19, 51), (100, 100)]
    assert not out.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=3e-6)
    else:  # SDPA rounds its bf16 products its own way; one bf16 step or two apart
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=2e-3)
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):  # the same store
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)

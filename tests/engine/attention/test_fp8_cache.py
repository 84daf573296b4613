"""An fp8 KV cache through every backend that reads one: the torch reference, the
compiled CPU decode and the Triton kernels. The oracle is a cache in float32 holding
exactly the values the fp8 bytes stand for (byte x scale): reading the fp8 cache must
be reading those values, and storing into it must round each new K/V as to_fp8
does."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.engine.kernels.attention import AttentionBackendError, make_backend
from kvserve.engine.kernels.attention.torch_backend import TorchBackend
from kvserve.engine.kernels.fp8_cache import FP8, FP8_MAX, to_fp8
from tests.engine.attention.paged_batch import (DEVICE, PagedBatch, make_batch,
                                               needs_kernel_device)
from tests.engine.attention.test_triton_backend import PAD, with_padding
from tests.engine.attention.tolerances import assert_close

# Random K/V are N(0, 1): |x| / scale reaches ~4.5 / 0.02 = 225, half the fp8 range,
# as the calibrated scales place the largest values (kv_fp8.HEADROOM).
K_SCALE, V_SCALE = torch.tensor(0.02), torch.tensor(0.018)
# 3 decodes, 2 prefix-hit chunks, a chunk starting mid-block, 2 fresh prompts, and
# 3 short queries (speculative verifications take the torch backend's padded path).
Q_LENS = [1, 1, 1, 40, 7, 19, 100, 3, 4, 2]
SEQ_LENS = [300, 2, 129, 90, 64, 51, 100, 3, 37, 18]


def fp8_and_twin(b: PagedBatch) -> tuple[PagedBatch, PagedBatch]:
    """The batch with an fp8 cache, and its float32 twin: the same values rounded
    through fp8 (prefix and new tokens alike), in float32."""
    def rounded(x, scale):
        return to_fp8(x, scale).float() * scale
    kc, vc = to_fp8(b.k_cache, K_SCALE), to_fp8(b.v_cache, V_SCALE)
    fp8 = dataclasses.replace(b, k_cache=kc, v_cache=vc)
    twin = dataclasses.replace(b, k=rounded(b.k, K_SCALE), v=rounded(b.v, V_SCALE),
                               k_cache=kc.float() * K_SCALE, v_cache=vc.float() * V_SCALE)
    return fp8, twin


def run(backend, b: PagedBatch, scales=(None, None)):
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    out = backend.forward(b.q, b.k, b.v, k_cache, v_cache, backend.prepare(b.meta), b.scale,
                          *scales)
    return out, k_cache, v_cache


def test_to_fp8_keeps_two_digits_and_saturates():
    # |x| / scale from 0.03 to 316: e4m3's normal range (2**-6 .. 448).
    x = torch.cat([torch.logspace(-2.5, 1.5, 500), -torch.logspace(-2.5, 1.5, 500)])
    back = to_fp8(x, torch.tensor(0.1)).float() * 0.1
    assert ((back - x).abs() <= x.abs() * 2 ** -4).all()  # 3 mantissa bits, rounded
    huge = to_fp8(torch.tensor([1e6, -1e6, float("inf")]), torch.tensor(1.0)).float()
    assert huge.tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]


@pytest.mark.parametrize("paged_decode", [False, True])
def test_torch_backend_reads_the_values_its_bytes_stand_for(paged_decode):
    # The paged decode reads a request's whole last block and masks the scores past
    # its length: a NaN there would still reach the output through 0 x NaN, so its
    # unowned slots hold a finite poison.
    b = make_batch(Q_LENS, SEQ_LENS, 8, 2, 64, 16, seed=3,
                   poison=100.0 if paged_decode else float("nan"))
    fp8, twin = fp8_and_twin(b)
    out, k_cache, v_cache = run(TorchBackend(paged_decode), fp8, (K_SCALE, V_SCALE))
    ref, ref_k, ref_v = run(TorchBackend(), twin)
    assert_close(out, ref)
    assert k_cache.dtype == FP8
    # Stored bytes stand for exactly the twin's stored values (poison included).
    for got, want, s in ((k_cache, ref_k, K_SCALE), (v_cache, ref_v, V_SCALE)):
        torch.testing.assert_close(got.float() * s, want, atol=0, rtol=0, equal_nan=True)


def test_fp8_cache_is_close_to_the_unrounded_attention():
    b = make_batch(Q_LENS, SEQ_LENS, 8, 2, 64, 16, seed=4)
    fp8, _ = fp8_and_twin(b)
    out, *_ = run(TorchBackend(), fp8, (K_SCALE, V_SCALE))
    exact, *_ = run(TorchBackend(), b)
    # Each K and V value is off by up to 1/16 of itself: a query that sees a single
    # key returns that key's V, off by up to |V| / 16 (|V| < 4.5 here); attention
    # over more keys averages the errors away.
    error = (out - exact).abs()
    assert error.max() < 4.5 / 16
    assert error.mean() < 0.01


@needs_kernel_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_the_torch_backend_on_an_fp8_cache(dtype):
    from kvserve.engine.kernels.attention.triton_backend import TritonBackend

    b = make_batch(Q_LENS[:8], SEQ_LENS[:8], 8, 2, 64, 16, dtype, seed=5)
    fp8, _ = fp8_and_twin(b)
    fp8 = with_padding(fp8)
    scales = (K_SCALE.to(b.q.device), V_SCALE.to(b.q.device))
    out, k_cache, v_cache = run(TritonBackend(), fp8, scales)
    ref, ref_k, ref_v = run(TorchBackend(), fp8, scales)
    real = fp8.meta.num_tokens - PAD
    assert_close(out[:real], ref[:real])
    # Both stores round alike and skip the padded tokens: identical bytes.
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_flash_attn_refuses_an_fp8_cache():
    with pytest.raises(AttentionBackendError, match="fp8"):
        make_backend("flash-attn", torch.device("cpu"), 256, torch.bfloat16, FP8)


@needs_kernel_device
def test_triton_store_rounds_like_torch_at_ties_carries_and_subnormals():
    from kvserve.engine.kernels.attention.triton import store_kv_cache

    # Every e4m3 value, the midpoints between neighbours (ties go to even), values
    # just beside them, and beyond the range (saturated).
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids * (1 + 2 ** -12), mids * (1 - 2 ** -12),
                   torch.tensor([500.0, -1e4, 3e-5, -2 ** -10])])
    x = torch.cat([x, x.new_zeros(-len(x) % 64)]).view(-1, 1, 64).to(DEVICE)
    scale = torch.tensor(1.0, device=DEVICE)
    caches = [torch.zeros(len(x), 1, 1, 64, dtype=FP8, device=DEVICE) for _ in range(2)]
    slots = torch.arange(len(x), device=DEVICE)
    store_kv_cache(x, x, *caches, slots, scale, scale)
    want = to_fp8(x, scale).view(torch.uint8).cpu()
    assert torch.equal(caches[0].view(torch.uint8).view(-1, 1, 64).cpu(), want)

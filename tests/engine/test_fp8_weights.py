"""--quantization fp8: the layer's arithmetic (through the CPU build's own
torch._scaled_mm, the op cuBLASLt runs on the GPU), and the start-up errors where
there are no fp8 tensor cores or the shapes do not fit the GEMM. Its speed is the
GPU session's to measure (bench/gpu_session.sh)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.engine.kernels.fp8_cache import FP8_MAX
from kvserve.engine.models.quantized.fp8 import (Fp8Linear, check_fp8_device, check_fp8_shapes,
                                                 quantize_fp8, quantize_rows)
from kvserve.modelstore.errors import ModelLoadError


def test_each_row_spans_the_fp8_range():
    w = torch.randn(48, 64) * torch.logspace(-3, 2, 48)[:, None]
    w[5] = 0
    q, scales = quantize_fp8(w)
    peaks = q.float().abs().amax(dim=1)
    assert torch.equal(peaks[torch.arange(48) != 5], torch.full((47,), FP8_MAX))
    assert peaks[5] == 0 and scales[5] == 1  # an all-zero row: no division by zero
    # Three mantissa bits: within 1/16 of each weight (above e4m3's subnormals).
    big = (w / scales[:, None]).abs() > 2 ** -6
    assert ((q.float() * scales[:, None] - w).abs() <= w.abs() / 16)[big].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 48])
def test_fp8_linear_is_its_quantized_operands_product(dtype, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(128, 96, bias=True).to(dtype)
    layer = Fp8Linear.of(linear)
    x = torch.randn(2, rows, 128).to(dtype)
    got = layer(x)
    assert got.shape == (2, rows, 96) and got.dtype == dtype
    xq, xs = quantize_rows(x.reshape(-1, 128))
    exact = (xq.float() * xs) @ (layer.qweight.float() * layer.scales.reshape(-1, 1)).T
    want = (exact.to(torch.bfloat16).to(dtype) + linear.bias).reshape(2, rows, 96)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    # And near the float layer: weights and activations each within 1/16.
    full = linear(x).float()
    assert (got.float() - full).abs().mean() < 0.05 * full.abs().mean()


def test_the_cpu_is_refused_naming_what_works(tiny_engine_factory):
    with pytest.raises(ModelLoadError, match="8.9 or newer.*use --quantization int8 or int4"):
        check_fp8_device(torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="fp8 tensor cores"):
        tiny_engine_factory(quantization="fp8")


def test_shapes_off_the_gemms_multiple_of_16_are_refused():
    with pytest.raises(ModelLoadError, match="layers.0.mlp.down_proj is 64x72"):
        check_fp8_shapes([("layers.0.mlp.down_proj", nn.Linear(72, 64))])

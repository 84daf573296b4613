"""Weight-only int8 (--quantization int8): the kernel against a float reference on
random shapes, the layers it replaces, and the default model's perplexity on the
shipped text within 1% of the float weights' (bench/quality.py measures the whole
text, in fp32 and bf16, with greedy agreement)."""
from __future__ import annotations

import pytest
import torch

from bench.quality import perplexity, text_tokens
from engine.config import EngineConfig
from engine.engine import Engine
from engine.models.quantized import Int8Linear, quantize_int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n, k", [(1, 64, 32), (7, 96, 160), (33, 576, 1536)])
def test_int8_linear_matches_its_dequantized_weights(dtype, rows, n, k):
    gen = torch.Generator().manual_seed(rows * n + k)
    linear = torch.nn.Linear(k, n, bias=True, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(n, generator=gen))
    x = torch.randn(rows, k, generator=gen).to(dtype)
    layer = Int8Linear.of(linear)
    dequantized = layer.qweight.float() * layer.scales.float()[:, None]
    reference = x.float() @ dequantized.T + linear.bias.float()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(layer(x).float(), reference, atol=tolerance, rtol=tolerance)
    # and the rounding error itself: at most half a step of each channel's scale
    error = (dequantized - linear.weight.float()).abs()
    assert bool((error <= layer.scales.float()[:, None] * 0.5 + 1e-6).all())


def test_quantize_int8_uses_all_levels_and_keeps_zero_rows():
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]])
    q, scales = quantize_int8(w, torch.float32)
    assert q[0].tolist() == [127, -64, 32] and q[1].tolist() == [0, 0, 0]
    assert bool(torch.isfinite(scales).all())


@pytest.fixture(scope="module")
def float_engine(default_model_dir):
    return Engine(EngineConfig(model=str(default_model_dir), dtype="float32", num_kv_blocks=256))


def test_the_default_model_in_int8_stays_within_one_percent_perplexity(
        default_model_dir, float_engine):
    int8 = Engine(EngineConfig(model=str(default_model_dir), dtype="float32",
                               num_kv_blocks=256, quantization="int8"))
    layers = [m for m in int8.runner.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * int8.runner.model.config.num_layers
    assert not isinstance(int8.runner.model.lm_head, Int8Linear)
    tokens = text_tokens(float_engine)
    assert len(tokens) > 2000  # the whole text is bench/quality.py's; a part here
    tokens = tokens[:512]
    base, quantized = perplexity(float_engine, tokens), perplexity(int8, tokens)
    assert quantized / base - 1 < 0.01, (base, quantized)

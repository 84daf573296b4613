"""Activation-aware scaling (--quantization int4-awq | int8-awq): the scale search
beats round-to-nearest where a few input channels are large and never loses to it,
the scaled layers compute the same function, and the start-up errors of int4."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.models.quantized.int4 import Int4Linear, fake_quantize_int4
from kvserve.engine.models.quantized.int8 import Int8Linear, fake_quantize_int8
from kvserve.engine.weights.quantization.awq import search_scales
from kvserve.modelstore.errors import ModelLoadError


def _outlier_inputs(gen: torch.Generator, rows: int = 256, k: int = 256) -> torch.Tensor:
    """Activations with four channels 50x the others, as the seeds describe."""
    x = torch.randn(rows, k, generator=gen)
    x[:, [3, 77, 130, 200]] *= 50
    return x


def _error(x, w, w_hat) -> float:
    return float((x @ w_hat.T - x @ w.T).pow(2).mean())


@pytest.mark.parametrize("fake", [fake_quantize_int8, lambda w: fake_quantize_int4(w, 64)])
def test_the_scale_search_beats_round_to_nearest_on_outlier_channels(fake):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=gen) * 0.05
    x = _outlier_inputs(gen)
    s = search_scales(w, x, fake, torch.float32)
    rtn, awq = _error(x, w, fake(w)), _error(x, w, fake(w * s) / s)
    assert awq < 0.7 * rtn, (awq, rtn)


def test_without_outliers_the_search_is_never_worse_than_round_to_nearest():
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 128, generator=gen), torch.randn(64, 128, generator=gen)
    fake = lambda v: fake_quantize_int4(v, 32)  # noqa: E731
    s = search_scales(w, x, fake, torch.float32)
    assert _error(x, w, fake(w * s) / s) <= _error(x, w, fake(w)) + 1e-12


@pytest.mark.parametrize("make", [lambda lin, s: Int8Linear.of(lin, s),
                                  lambda lin, s: Int4Linear.of(lin, 32, s)])
def test_a_scaled_layer_computes_its_quantized_scaled_weights_over_scaled_inputs(make):
    """y = (x / s) @ Q(W * s)^T: exactly what its own weights and scales give, and
    as close to x @ W^T as the unscaled layer is."""
    gen = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 128, generator=gen) * 0.05)
    s = torch.rand(128, generator=gen) + 0.5
    layer = make(linear, s)
    x = torch.randn(5, 128, generator=gen)
    unscaled = make(linear, None)
    if isinstance(layer, Int8Linear):
        w_hat = layer.qweight.float() * layer.scales[:, None]
    else:
        w_hat = layer.dequantized_t(torch.float32).T
    torch.testing.assert_close(layer(x), (x / s) @ w_hat.T, atol=1e-5, rtol=1e-5)
    exact = x @ linear.weight.detach().T

    def relative_error(y):
        return float((y - exact).norm() / exact.norm())
    assert relative_error(layer(x)) < 2 * relative_error(unscaled(x)) < 0.3


def test_activation_aware_needs_a_tokenizer_to_read_its_calibration_text():
    with pytest.raises(ModelLoadError, match="needs the model's tokenizer"):
        Engine(EngineConfig(model="preset:llama-tiny", load_format="random",
                            quantization="int4-awq", num_kv_blocks=16))


@pytest.mark.parametrize("option", [{"quantization": "int8-awq"}, {"kv_cache_dtype": "fp8"}])
def test_calibration_with_a_shorter_max_model_len_than_its_text_serves(tiny_model_dir, option):
    """The calibration pass takes the text's first 512 tokens, cut to the positions
    the model was built for (it once ran past them and stopped start-up)."""
    from kvserve.scheduler.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=64,
                                 num_kv_blocks=16, **option))
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0,
                                                      ignore_eos=True))
    assert len(out[0]) == 4


def test_int4_on_shapes_it_cannot_hold_stops_start_up_naming_what_works(tiny_model_dir):
    """The tiny test model: 96 inputs (32 divides them, 64 does not) and a q/k/v
    projection of 160 rows (not in blocks of 64)."""
    model = str(tiny_model_dir("llama"))
    with pytest.raises(ModelLoadError, match="does not divide .* 96 inputs; this model takes 32"):
        Engine(EngineConfig(model=model, quantization="int4", quantization_group_size=64,
                            num_kv_blocks=16))
    with pytest.raises(ModelLoadError, match="blocks of 64.* use --quantization int8"):
        Engine(EngineConfig(model=model, quantization="int4", num_kv_blocks=16))


def test_int4_on_a_random_preset_serves(tmp_path):
    engine = Engine(EngineConfig(model="preset:llama-tiny", load_format="random",
                                 quantization="int4", num_kv_blocks=16))
    layers = [m for m in engine.runner.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * 2
    from kvserve.scheduler.sampling_params import SamplingParams

    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0,
                                                      ignore_eos=True))
    assert len(out[0]) == 4


def test_int4_in_compiled_mixed_steps_never_recompiles():
    """bf16, where torch's int4 kernel takes steps of a few rows: mixed steps of
    every token count, above and below the kernel's limit, run through the graphs
    built at start-up."""
    import random

    from kvserve.engine.runner.compile_process import graphs_compiled
    from kvserve.scheduler.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model="preset:llama-tiny", load_format="random",
                                 quantization="int4", dtype="bfloat16", num_kv_blocks=256,
                                 max_num_batched_tokens=37, compile="wait"))
    assert engine.runner.compiled is not None
    rng = random.Random(4)
    before = graphs_compiled()
    for i in range(24):
        engine.add_request(f"r{i}", [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 70))],
                           SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0,
                                          ignore_eos=True))
        for _ in range(rng.choice([0, 1, 2])):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert graphs_compiled() == before

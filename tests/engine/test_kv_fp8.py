"""--kv-cache-dtype fp8 on whole engines (tiny random models): twice the blocks of
bf16 in the same memory, scales calibrated on the shipped text, the Triton backend
(interpreted) and the compiled CPU decode path agreeing with the torch reference on
the same fp8 cache, and a clear error for an unknown cache dtype. The default
model's perplexity cost is in tests/engine/test_quantization.py."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.fp8_cache import FP8, FP8_MAX
from kvserve.engine.kernels.fp8_cache import key_rotation, rotate
from kvserve.engine.weights.quantization.calibration import calibration_tokens
from kvserve.engine.weights.quantization.kv_fp8 import HEADROOM
from kvserve.modelstore.errors import ModelLoadError
from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.attention.test_engine_triton import assert_same_run, prompts
from tests.engine.attention.test_engine_triton import record_logits

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_an_fp8_cache_holds_twice_the_blocks_of_bf16_in_the_same_memory(
        tiny_engine_factory):
    blocks = {kv: tiny_engine_factory(dtype="bfloat16", num_kv_blocks=None,
                                      kv_cache_memory=8 << 20, kv_cache_dtype=kv)
              .scheduler.kv.num_blocks for kv in ("auto", "fp8")}
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_scales_put_the_calibration_texts_largest_values_at_half_the_range(
        tiny_engine_factory):
    fp8 = tiny_engine_factory(dtype="float32", kv_cache_dtype="fp8")
    assert all(k.dtype == FP8 for k, _ in fp8.runner.kv_caches)
    # The same text as a prompt through a float cache: its largest |K| (turned as the
    # fp8 cache holds keys) and |V| per layer are what the scales were taken from.
    # As the calibration pass computes it: one chunk, the torch backend (on a GPU the
    # Triton kernels and a chunked prefill round differently from it).
    plain = tiny_engine_factory(dtype="float32", attention_backend="torch",
                                max_num_batched_tokens=1024)
    plain.generate([calibration_tokens(plain.tokenizer, "test")],
                   SamplingParams(max_tokens=1, temperature=0.0))
    rotation = key_rotation(plain.model_config.head_dim)
    for layer, (k, v) in zip(fp8.runner.model.layers, plain.runner.kv_caches):
        k_scale, v_scale = layer.self_attn.kv_scales
        torch.testing.assert_close(layer.self_attn.key_rotation, rotation)
        for scale, cache in ((k_scale, k @ rotation), (v_scale, v)):
            # cuBLAS picks its kernels by shape, and the engine pads its steps.
            torch.testing.assert_close(scale * FP8_MAX / HEADROOM, cache.abs().amax(),
                                       rtol=1e-5 if cache.is_cpu else 1e-4, atol=0)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_the_key_rotation_is_orthogonal(head_dim):
    r = key_rotation(head_dim)
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim), atol=1e-5, rtol=0)
    assert torch.equal(r, key_rotation(head_dim))  # the same in every process
    if head_dim == 64:  # Hadamard: every entry +-1/8, every key channel spread
        assert torch.equal(r.abs(), torch.full_like(r, 1 / 8))
    # The CPU's butterflies (power of two) or matmul give the rotation's product.
    x = torch.randn(5, 3, head_dim)
    torch.testing.assert_close(rotate(x, r), x @ r, atol=1e-5, rtol=1e-5)


def test_the_triton_backend_reads_and_writes_the_fp8_cache_as_the_torch_backend(
        tiny_engine_factory):
    # Mixed prefill chunks and decodes; logits within 1e-4 step by step.
    assert_same_run(tiny_engine_factory, "llama", [prompts(3, 90, 41, seed=7)], GREEDY,
                    max_num_batched_tokens=48, kv_cache_dtype="fp8")


def test_compiled_decode_graphs_read_the_fp8_cache_as_eager_steps_do(tiny_engine_factory):
    """Decode steps through the compiled CPU graphs (attention traced in, scales
    applied to scores and outputs) give the eager fp8 path's logits. On the CPU even
    beside a GPU: there, decode steps would replay CUDA graphs past forward_logits."""
    runs = []
    for compile in ("off", "wait"):
        engine = tiny_engine_factory(dtype="float32", kv_cache_dtype="fp8", compile=compile,
                                     device="cpu")
        steps = record_logits(engine)
        runs.append((engine.generate(prompts(20, 7, seed=8), GREEDY), steps))
    (eager, eager_steps), (compiled, compiled_steps) = runs
    assert compiled == eager
    for i, (a, b) in enumerate(zip(compiled_steps, eager_steps, strict=True)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {i}: {m}")


def test_speculative_early_exit_drafts_through_the_fp8_cache(tiny_engine_factory):
    from kvserve.engine.config.engine_config import SpeculativeConfig

    spec = SpeculativeConfig(method="early-exit", num_tokens=3, draft_layers=1)
    want = tiny_engine_factory(dtype="float32", kv_cache_dtype="fp8").generate(
        prompts(25, seed=9), GREEDY)
    got = tiny_engine_factory(dtype="float32", kv_cache_dtype="fp8",
                              speculative=spec).generate(prompts(25, seed=9), GREEDY)
    assert got == want  # verification keeps greedy output exact


def test_an_unknown_cache_dtype_is_a_load_error_naming_the_choices(tiny_engine_factory):
    with pytest.raises(ModelLoadError, match="auto, fp8, fp8_e4m3"):
        tiny_engine_factory(kv_cache_dtype="int4")

"""--quantization int8 on mixture-of-experts models: the routed experts held as int8
with a scale per output row (half of bf16's bytes), the router left exact, and the
engine's greedy tokens equal to the same engine's float model holding the values
the int8 weights stand for, eagerly and through the compiled batch-1 graph."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.models.moe import FusedExperts, SparseMoE
from kvserve.engine.models.quantized.int8 import Int8Linear, fake_quantize_int8
from kvserve.engine.weights.quantization.awq import decoder_linears
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import varied_prompts


def _engine(model_dir, quantization: str, compile: str = "off") -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", quantization=quantization,
                               cpu_kernels="torch", num_kv_blocks=256, compile=compile,
                               max_num_batched_tokens=37))


def _as_int8_values(engine: Engine) -> None:
    """The float model made to hold exactly what int8 quantization keeps."""
    model = engine.runner.model
    for _, parent, _, linear in decoder_linears(model):
        if not isinstance(parent, SparseMoE):
            linear.weight.data = fake_quantize_int8(linear.weight.data)
    for experts in (m for m in model.modules() if isinstance(m, FusedExperts)):
        for w in (experts.w13, experts.w2):
            w.data = fake_quantize_int8(w.data.reshape(-1, w.shape[-1])).view(w.shape)


@pytest.mark.parametrize("family", ["qwen3moe", "mixtral", "gptoss", "deepseekv3", "qwen2moe"])
def test_int8_experts_generate_as_the_values_they_hold(tiny_model_dir, family):
    model_dir = tiny_model_dir(family)
    int8 = _engine(model_dir, "int8")
    model = int8.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.w13.dtype == m.w2.dtype == torch.int8 for m in experts)
    assert not any(isinstance(m.gate, Int8Linear) for m in model.modules()
                   if isinstance(m, SparseMoE))  # the router stays exact
    reference = _engine(model_dir, "none")
    _as_int8_values(reference)
    prompts = varied_prompts(int8.model_config.vocab_size, count=4, seed=5,
                             lengths=(3, 40, 90, 17))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert int8.generate(prompts, params) == reference.generate(prompts, params)


def test_int8_experts_in_the_compiled_batch_one_graph(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3moe")
    compiled = _engine(model_dir, "int8", compile="wait")
    assert compiled.runner.compiled is not None
    reference = _engine(model_dir, "none")
    _as_int8_values(reference)
    prompt = varied_prompts(compiled.model_config.vocab_size, count=1, seed=9, lengths=(30,))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert compiled.generate(prompt, params) == reference.generate(prompt, params)


def test_the_memory_check_counts_int8_experts(tiny_model_dir):
    """weight_bytes (the memory check, kvserve estimate) equals what the int8 model
    holds: experts a byte a weight with a float32 scale a row, the router float."""
    from kvserve.engine.weights.quantization import resident_bytes
    from kvserve.modelstore.weight_bytes import weight_bytes

    engine = _engine(tiny_model_dir("qwen3moe"), "int8")
    model = engine.runner.model
    assert weight_bytes(engine.model_config, 4, "int8") == resident_bytes(model)

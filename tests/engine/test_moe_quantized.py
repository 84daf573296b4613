"""--quantization int8 / int4 on mixture-of-experts models: the routed experts held
as int8 with a scale per output row (half of bf16's bytes) or as 4-bit codes two to a
byte with a scale and a minimum per group of 32 inputs, the router left exact, and
the engine's greedy tokens equal to the same engine's float model holding the values
the quantized weights stand for, eagerly and through the compiled batch-1 graph."""
from __future__ import annotations

from functools import partial

import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.models.moe import FusedExperts, SparseMoE
from kvserve.engine.models.quantized.int4 import fake_quantize_int4
from kvserve.engine.models.quantized.int8 import Int8Linear, fake_quantize_int8
from kvserve.engine.weights.quantization.awq import decoder_linears
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.reference import varied_prompts

# what each mode keeps of a [N, K] weight, as float32; the experts' dtype
FAKE = {"int8": fake_quantize_int8, "int4": partial(fake_quantize_int4, group_size=32)}
STORED = {"int8": torch.int8, "int4": torch.uint8}


def _engine(model_dir, quantization: str, compile: str = "off") -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", quantization=quantization,
                               cpu_kernels="torch", num_kv_blocks=256, compile=compile,
                               max_num_batched_tokens=37))


def _as_quantized_values(engine: Engine, kind: str) -> None:
    """The float model made to hold exactly what `kind` quantization keeps."""
    model, fake = engine.runner.model, FAKE[kind]
    for _, parent, _, linear in decoder_linears(model):
        if not isinstance(parent, SparseMoE):
            linear.weight.data = fake(linear.weight.data)
    for experts in (m for m in model.modules() if isinstance(m, FusedExperts)):
        for w in (experts.w13, experts.w2):
            w.data = fake(w.data.reshape(-1, w.shape[-1])).view(w.shape)


@pytest.fixture
def exact_products(monkeypatch):
    """--quantization int8's experts multiplied by x itself, not by x quantized to
    int8 where kvserve's kernels run (they may in this process whatever cpu_kernels
    says: they are loaded once for every engine): compared exactly here, the int8
    inputs in tests/engine/moe/test_expert_linear.py."""
    quantize = FusedExperts.quantize_int8

    def without_int8_inputs(self):
        quantize(self)
        self.int8_inputs = False

    monkeypatch.setattr(FusedExperts, "quantize_int8", without_int8_inputs)


# int4's dense projections need rows in blocks of 64 and whole groups of 32 inputs
INT4_SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=192, moe_intermediate_size=64)
CASES = [(f, "int8") for f in ("qwen3moe", "mixtral", "gptoss", "deepseekv3", "qwen2moe")] + \
    [(f, "int4") for f in ("qwen3moe", "mixtral", "gptoss")]


@pytest.fixture(scope="module")
def model_for(tiny_model_dir, tmp_path_factory):
    """(family, kind) -> a tiny checkpoint the kind can quantize, made once."""
    from tests.support.tiny_models import make_tiny_model

    made = {}

    def make(family: str, kind: str):
        if kind == "int8":
            return tiny_model_dir(family)
        if family not in made:
            made[family] = make_tiny_model(tmp_path_factory.mktemp(f"int4-{family}"), family,
                                           **INT4_SHAPE)
        return made[family]
    return make


@pytest.mark.parametrize("family, kind", CASES)
def test_quantized_experts_generate_as_the_values_they_hold(model_for, family, kind,
                                                           exact_products):
    model_dir = model_for(family, kind)
    quantized = _engine(model_dir, kind)
    model = quantized.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(m.w13.dtype == m.w2.dtype == STORED[kind] for m in experts)
    assert not any(isinstance(m.gate, Int8Linear) for m in model.modules()
                   if isinstance(m, SparseMoE))  # the router stays exact
    reference = _engine(model_dir, "none")
    _as_quantized_values(reference, kind)
    prompts = varied_prompts(quantized.model_config.vocab_size, count=4, seed=5,
                             lengths=(3, 40, 90, 17))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert quantized.generate(prompts, params) == reference.generate(prompts, params)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_experts_in_the_compiled_batch_one_graph(model_for, kind, exact_products):
    model_dir = model_for("qwen3moe", kind)
    compiled = _engine(model_dir, kind, compile="wait")
    assert compiled.runner.compiled is not None
    reference = _engine(model_dir, "none")
    _as_quantized_values(reference, kind)
    prompt = varied_prompts(compiled.model_config.vocab_size, count=1, seed=9, lengths=(30,))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert compiled.generate(prompt, params) == reference.generate(prompt, params)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_memory_check_counts_quantized_experts(model_for, kind):
    """weight_bytes (the memory check, kvserve estimate) equals what the quantized
    model holds: int8 experts a byte a weight with a float32 scale a row, int4 half a
    byte with a float32 scale and minimum a group; the router float."""
    from kvserve.engine.weights.quantization import resident_bytes
    from kvserve.modelstore.weight_bytes import weight_bytes

    engine = _engine(model_for("qwen3moe", kind), kind)
    model = engine.runner.model
    assert weight_bytes(engine.model_config, 4, kind) == resident_bytes(model)


def test_an_expert_width_the_groups_do_not_divide_is_a_start_up_error():
    from kvserve.engine.models.moe import FusedExperts as Experts
    from kvserve.engine.weights.quantization import _check_expert_groups
    from kvserve.modelstore.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"experts' \(w2\) 48 inputs"):
        _check_expert_groups(Experts(2, 0, hidden=64, intermediate=48), 32)


def test_int8_experts_take_int8_inputs_and_int4_ones_do_not():
    """--quantization int8's experts meet x quantized to int8 where kvserve's CPU
    kernels run (as llama.cpp's Q8_0 experts do); int4's and float ones do not."""
    for kind, expected in (("int8", True), ("int4", False), (None, False)):
        experts = FusedExperts(4, 0, hidden=64, intermediate=32)
        with torch.no_grad():
            experts.w13.normal_()
            experts.w2.normal_()
        if kind == "int8":
            experts.quantize_int8()
        elif kind == "int4":
            experts.quantize_int4(32)
        assert experts.int8_inputs is expected, kind

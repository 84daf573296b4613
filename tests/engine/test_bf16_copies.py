"""bf16 copies of float32 weights for the compiled batch-1 decode on CPU
(engine/models/bf16_copies.py): made only where they are exact, read by the batch-1
graph as bf16 (not folded back into float32 constants), and the greedy output the
same as eager float32's and transformers'."""
from __future__ import annotations

import pytest
import torch
import torch._inductor.config
from torch._inductor.constant_folding import _dont_constant_fold
from torch._inductor.utils import run_and_get_code

from engine.models.bf16_copies import (Linear, add_bf16_copies, bytes_saved_at_batch_one,
                                       conversions_kept, has_bf16_copies)
from scheduler.sampling_params import SamplingParams
from tests.support.reference import (assert_same_tokens, load_reference, reference_greedy,
                                     varied_prompts)
from tests.support.tiny_models import make_tiny_model

GREEDY_48 = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def test_copies_are_made_only_of_exact_bf16_weights():
    exact, inexact = Linear(64, 32, bias=False), Linear(64, 32, bias=False)
    with torch.no_grad():
        exact.weight.copy_(exact.weight.bfloat16().float())
        inexact.weight.copy_(exact.weight + 1e-6)  # bits below bf16's
    model = torch.nn.Sequential(exact, inexact, torch.nn.Linear(64, 64))
    assert add_bf16_copies(model) == 64 * 32 * 2
    assert exact.bf16_weight.dtype == torch.bfloat16
    assert torch.equal(exact.bf16_weight.float(), exact.weight)
    assert inexact.bf16_weight is None
    assert has_bf16_copies(model)
    assert bytes_saved_at_batch_one(model) == 64 * 32 * (4 - 2)


def test_the_compiled_row_reads_the_copy_in_bf16():
    """Inductor's freezing would fold the widening into a float32 constant; under
    conversions_kept the kernel loads bf16, and the product is the float32 one."""
    layer = Linear(256, 512, bias=True).eval()
    with torch.no_grad():
        layer.weight.copy_(layer.weight.bfloat16().float())
    add_bf16_copies(layer)
    x = torch.randn(1, 256)
    with (torch._inductor.config.patch(freezing=True), torch.inference_mode(),
          conversions_kept()):
        # (A function of its own: Dynamo keeps graphs per code object, and
        # Linear.forward's is every model's.)
        out, code = run_and_get_code(torch.compile(lambda x: layer(x), dynamic=False), x)
    assert "BFloat16" in "\n".join(code)
    assert torch.allclose(out, torch.nn.functional.linear(x, layer.weight, layer.bias),
                          rtol=1e-5, atol=1e-5)
    assert torch.ops.prims.convert_element_type.default not in _dont_constant_fold


def test_eager_rows_use_the_float32_weight():
    layer = Linear(16, 8, bias=False)
    layer.bf16_weight = torch.zeros(8, 16, dtype=torch.bfloat16)  # never read eagerly
    x = torch.randn(1, 16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-bf16"), dtype=torch.bfloat16)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_matches_eager_float32_and_transformers(bf16_model_dir, batch):
    """A bf16 checkpoint served in float32: compiled, its batch-1 decodes read the
    copies; its tokens are eager float32's and transformers' (float32)."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    def engine(**overrides):
        return Engine(EngineConfig(model=str(bf16_model_dir), dtype="float32",
                                   num_kv_blocks=256, max_num_batched_tokens=37,
                                   **overrides))

    compiled = engine(compile="wait")
    assert has_bf16_copies(compiled.runner.model)
    prompts = varied_prompts(compiled.model_config.vocab_size, count=6, seed=3)
    got = []
    for i in range(0, len(prompts), batch):
        got += compiled.generate(prompts[i:i + batch], GREEDY_48)
    eager = engine(compile="off")
    assert not has_bf16_copies(eager.runner.model)  # made for compiled graphs only
    ref = load_reference(bf16_model_dir)
    assert_same_tokens(ref, prompts, got, eager.generate(prompts, GREEDY_48))
    assert_same_tokens(ref, prompts, got, [reference_greedy(ref, p, 48) for p in prompts])
    assert compiled.scheduler.kv.num_free_blocks == compiled.scheduler.kv.num_blocks

"""--quantization int4-sym: GGUF Q4_0's symmetric grid, w = (q - 8) * scale, each
group's scale its value of largest magnitude over -8. Held as int4 with minimums
-8 * scale everywhere (torch's kernels, CUDA), and packed without them for kvserve's
CPU kernels, which derive them (4.5 bits a weight, not 5)."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.kernels.cpu import packing
from kvserve.engine.kernels.cpu.packing import _group_panels, pack_int4
from kvserve.engine.models.quantized.int4 import Int4Linear, fake_quantize_int4, quantize_int4
from kvserve.engine.platform.device import cpu_flags
from kvserve.scheduler.sampling_params import SamplingParams
from tests.engine.test_quantization import layer_values
from tests.support.tiny_gguf import INT4_SHAPES
from tests.support.tiny_models import make_tiny_model

KERNELS_HERE = {"avx2", "fma", "f16c"} <= cpu_flags()


def test_symmetric_groups_keep_their_extreme_and_centre_zero():
    w = torch.tensor([[-2.0, 1.0, 0.5, 0.0] * 8,   # extreme negative: scale 0.25
                      [3.0, -1.0, 0.0, 0.75] * 8,  # extreme positive: scale -0.375
                      [0.0] * 32])                 # all zeros: zero stays exact
    q, scales, mins = quantize_int4(w, 32, symmetric=True)
    assert scales[:, 0].item() == 0.25 and scales[:, 1].item() == -0.375
    assert torch.equal(mins.float(), -8 * scales.float())
    assert q[0, :4].tolist() == [0, 12, 10, 8] and q[1, :4].tolist() == [0, 11, 8, 6]
    assert q[2].tolist() == [8] * 32
    values = fake_quantize_int4(w, 32, symmetric=True)
    assert values[0, 0] == -2.0 and values[1, 0] == 3.0 and bool((values[2] == 0).all())
    # round to nearest: within half a step of every weight the grid reaches
    step = scales.t().float().abs().repeat_interleave(32, dim=1)
    assert bool(((values - w).abs() <= step / 2 + 1e-6).all())


@pytest.fixture(scope="module")
def int4_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-int4-sym"), **INT4_SHAPES)


def test_the_engine_serves_symmetric_int4_packed_without_minimums(int4_model_dir, monkeypatch):
    """The layers hold Q4_0's grid of their float weights, packed without minimums,
    and serve the tokens of the same layers packed with -8 * scale stored (the same
    sums bit for bit; the kernel's own tests check each path)."""
    model_dir = str(int4_model_dir)

    def engine(quantization: str) -> Engine:
        return Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=64,
                                   quantization=quantization))

    floats = dict(engine("none").runner.model.named_modules())
    symmetric = engine("int4-sym")
    layers = {name: m for name, m in symmetric.runner.model.named_modules()
              if isinstance(m, Int4Linear)}
    assert len(layers) == 4 * symmetric.runner.model.config.num_layers
    for name, layer in layers.items():
        want = fake_quantize_int4(layer_values(floats[name]), 32, symmetric=True)
        assert torch.equal(layer_values(layer), want), name
        assert layer.packed is not None or not KERNELS_HERE
        assert layer.packed is None or layer.packed.mins is None

    def keeping_minimums(q, scales, mins):
        return pack_int4(q, scales, None)._replace(mins=_group_panels(mins))

    monkeypatch.setattr(packing, "pack_int4", keeping_minimums)
    stored = engine("int4-sym")
    assert all(m.packed.mins is not None for m in stored.runner.model.modules()
               if isinstance(m, Int4Linear) and m.packed is not None)
    prompt = [[5, 17, 42, 99, 7, 3, 250, 11], list(range(40, 90))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert symmetric.generate(prompt, params) == stored.generate(prompt, params)


def test_the_command_line_takes_int4_sym():
    from kvserve.server.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--quantization", "int4-sym"])
    assert args.quantization == "int4-sym"

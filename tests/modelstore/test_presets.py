"""Shipped model shapes (modelstore/presets): real Llama sizes counted on the meta device,
a tiny one run end to end with random weights and no tokenizer, and the CLI's checks."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig, ModelConfigError
from kvserve.engine.core.engine import Engine
from kvserve.engine.kernels.cpu.packing import unpack_weight
from kvserve.engine.platform import device as platform_device
from kvserve.engine.weights import loader
from kvserve.modelstore.presets import preset_names, resolve_model_path
from kvserve.modelstore.weight_bytes import weight_bytes
from kvserve.scheduler.sampling_params import SamplingParams

# Parameter counts of the released checkpoints (Hugging Face model cards / safetensors).
REAL_SIZES = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248}


def test_shipped_presets_and_unknown_names():
    assert {"llama-3.2-1b", "llama-3.1-8b", "llama-tiny"} <= set(preset_names())
    for bad in ("preset:nope", "preset:", "preset:../presets/llama-tiny"):
        with pytest.raises(ModelConfigError, match="unknown preset"):
            ModelConfig.from_pretrained(bad)


@pytest.mark.parametrize("name, hidden, layers, inter, tied, factor", [
    ("llama-3.2-1b", 2048, 16, 8192, True, 32.0),
    ("llama-3.1-8b", 4096, 32, 14336, False, 8.0),
])
def test_real_shapes_match_the_released_configs(name, hidden, layers, inter, tied, factor):
    cfg = ModelConfig.from_pretrained(f"preset:{name}")
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (hidden, layers, inter)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 8, hidden // 32)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (128256, 131072)
    assert cfg.tie_word_embeddings is tied
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("llama3", factor, 5e5)
    assert cfg.rope.original_max_position_embeddings == 8192
    assert (cfg.torch_dtype, cfg.eos_token_ids) == ("bfloat16", (128001,))


@pytest.mark.parametrize("name", sorted(REAL_SIZES))
def test_random_load_on_meta_counts_the_real_parameters(name, monkeypatch):
    # Nothing is allocated on the meta device, so no memory check may refuse an 8B
    # model there, however little memory the machine running the test has.
    real = platform_device.available_memory
    monkeypatch.setattr(platform_device, "available_memory",
                        lambda device: real(device) if device.type == "meta" else 1 << 20)
    cfg = ModelConfig.from_pretrained(f"preset:{name}")
    model = loader.load_model(f"preset:{name}", cfg, torch.bfloat16, torch.device("meta"),
                              max_positions=16, load_format="random")
    params = list(model.parameters())
    assert {p.device.type for p in params} == {"meta"}
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert sum(p.numel() for p in params) == REAL_SIZES[name]
    assert weight_bytes(cfg, 2) == 2 * REAL_SIZES[name]
    assert (model.lm_head.weight is model.embed_tokens.weight) is cfg.tie_word_embeddings


def tiny_engine(**overrides) -> Engine:
    cfg = dict(model="preset:llama-tiny", load_format="random", num_kv_blocks=64)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def test_tiny_preset_runs_token_ids_only():
    engine = tiny_engine()
    assert engine.tokenizer is None
    assert engine.eos_token_ids == (2,)  # from the preset's config.json
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(100, 160))]
    out = engine.generate(prompts, params)
    assert [len(o) for o in out] == [12, 12]
    assert all(0 <= t < 1024 for o in out for t in o)
    assert tiny_engine().generate(prompts, params) == out  # same seed, same weights


def test_tiny_preset_stops_at_the_config_eos():
    engine = tiny_engine()
    params = SamplingParams(max_tokens=8, temperature=0.0, logit_bias={2: 100.0})
    engine.add_request("r", [5, 6, 7], params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert outs[-1].new_token_ids == [2] and outs[-1].finish_reason == "stop"


def test_random_weights_are_made_in_place_in_the_target_dtype():
    model = tiny_engine(dtype="bfloat16").runner.model
    layer = model.layers[0].mlp.gate_up_proj
    if layer.packed is None:
        assert layer.weight.dtype == torch.bfloat16
        values = layer.weight.float()
    else:  # packed for kvserve's GEMM where the CPU takes bf16 layers: bf16 pair panels
        assert layer.packed.panels.dtype == torch.bfloat16
        values = unpack_weight(layer.packed.contents(), layer.out_features)
    assert 0.015 < values.std().item() < 0.025
    assert torch.all(model.norm.weight == 1)


def test_config_only_directory_is_like_a_preset(tmp_path):
    shutil.copy(resolve_model_path("preset:llama-tiny") / "config.json", tmp_path)
    engine = tiny_engine(model=str(tmp_path))
    assert engine.tokenizer is None
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert engine.generate([[1, 2, 3]], params) == tiny_engine().generate([[1, 2, 3]], params)


def test_a_preset_has_no_checkpoint_to_read():
    with pytest.raises(loader.ModelLoadError, match="--load-format random"):
        tiny_engine(load_format="safetensors")


def test_package_data_ships_every_preset():
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["kvserve.modelstore.presets"]
    shipped = {p for g in globs for p in (root / "modelstore" / "presets").glob(g)}
    assert {resolve_model_path(f"preset:{n}") / "config.json" for n in preset_names()} <= shipped


class TestCli:
    @pytest.fixture(autouse=True)
    def _no_env_defaults(self, monkeypatch):
        for flag in ("MODEL", "LOAD_FORMAT", "SERVED_MODEL_NAME"):
            monkeypatch.delenv(f"KVSERVE_{flag}", raising=False)

    def parse(self, *flags):
        from kvserve.server.entrypoints.cli import build_parser

        return build_parser().parse_args(["serve", *flags])

    def test_preset_with_random_weights(self):
        from kvserve.server.entrypoints.cli import engine_config_from_args, resolve_model

        args = self.parse("--model", "preset:llama-3.2-1b", "--load-format", "random")
        path, names = resolve_model(args)
        assert (path, names) == ("preset:llama-3.2-1b", ["preset:llama-3.2-1b"])
        assert engine_config_from_args(args, path).load_format == "random"

    @pytest.mark.parametrize("flags, message", [
        (("--model", "preset:llama-3.1-8b"), "add --load-format random"),
        (("--model", "preset:gpt-9", "--load-format", "random"), "unknown preset"),
    ])
    def test_clear_errors(self, flags, message):
        from kvserve.server.entrypoints.cli import resolve_model

        with pytest.raises(SystemExit) as exc:
            resolve_model(self.parse(*flags))
        assert message in str(exc.value.code)

"""Loading: clear errors for what cannot be served, and dtype handling."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig, ModelConfigError
from kvserve.engine.core.engine import Engine
from kvserve.engine.platform import device as platform_device
from kvserve.engine.weights.loader import ModelLoadError


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    edit_config(model, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        ModelConfig.from_pretrained(model)


def test_missing_config_and_missing_weights(tiny_model_dir, tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        Engine(EngineConfig(model=str(model), num_kv_blocks=8))


def test_checkpoint_missing_a_tensor(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    model = copy_model(tiny_model_dir("llama"), tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks 1 weights"):
        Engine(EngineConfig(model=str(model), num_kv_blocks=8))


def test_model_that_does_not_fit_in_memory(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(platform_device, "available_memory", lambda device: 1024)
    with pytest.raises(ModelLoadError, match="needs .* GiB but only"):
        Engine(EngineConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=8))


def test_kv_cache_that_does_not_fit(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(platform_device, "available_memory", lambda device: 200 * 2**20)
    with pytest.raises(ModelLoadError, match="KV cache needs"):
        Engine(EngineConfig(model=str(tiny_model_dir("llama")), kv_cache_memory=2**40))


def test_unknown_dtype_is_an_error():
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        platform_device.resolve_dtype("float8", torch.device("cpu"))


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it_natively(tmp_path):
    cpu = torch.device("cpu")
    assert platform_device.resolve_dtype("auto", cpu, flags={"avx2", "fma"}) == torch.float32
    bf16 = {"avx2", "avx512_bf16"}
    assert platform_device.resolve_dtype("auto", cpu, flags=bf16) == torch.bfloat16
    assert platform_device.resolve_dtype("auto", cpu, flags={"amx_bf16"}) == torch.bfloat16
    assert platform_device.resolve_dtype("auto", cpu, flags={"asimd", "bf16"}) == torch.bfloat16
    assert platform_device.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert platform_device.cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512_bf16"}
    assert platform_device.cpu_flags(str(tmp_path / "missing")) == set()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(tiny_engine_factory, dtype):
    from kvserve.scheduler.sampling_params import SamplingParams
    from tests.support.reference import varied_prompts

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = varied_prompts(400, count=4, seed=11)
    half = tiny_engine_factory(dtype=dtype)
    assert half.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    ours = half.generate(prompts, params)
    exact = tiny_engine_factory().generate(prompts, params)
    assert all(len(o) == 8 for o in ours)
    # Low precision may flip near-ties later on; the first token must agree.
    assert sum(o[0] == e[0] for o, e in zip(ours, exact)) >= 3


@pytest.mark.parametrize("cpu_kernels", ["torch", "kvserve"])
def test_tied_embeddings_share_storage(tmp_path, cpu_kernels):
    """One copy of a tied table: shared by the head and the embedding, or (kvserve's
    CPU kernels) the head's packed panels, which the embedding reads too."""
    from kvserve.engine.weights.cpu_packing import NEEDED_FLAGS
    from kvserve.engine.platform.device import cpu_flags
    from tests.support.tiny_models import make_tiny_model

    if cpu_kernels == "kvserve" and not set(NEEDED_FLAGS) <= cpu_flags():
        pytest.skip("kvserve's CPU kernels need AVX2, FMA and F16C")
    model_dir = make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=8, dtype="float32",
                                 cpu_kernels=cpu_kernels))
    m = engine.runner.model
    if cpu_kernels == "torch":
        assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    else:
        assert m.lm_head.weight is None and m.embed_tokens.weight is None
        assert m.embed_tokens.packed is m.lm_head.packed

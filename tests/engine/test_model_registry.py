"""The model registry: every architecture the config layer accepts has a model
class, and an unsupported one is refused with the list of supported ones."""
from __future__ import annotations

import json

import pytest

from kvserve.engine.config.architectures import ARCHITECTURES
from kvserve.engine.config.model_config import ModelConfig, ModelConfigError
from kvserve.engine.models.registry import MODEL_CLASSES


def test_config_and_registry_name_the_same_architectures():
    assert set(ARCHITECTURES) == set(MODEL_CLASSES)


def test_unsupported_architecture_lists_the_supported(tiny_model_dir, tmp_path):
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    config.update(architectures=["FalconForCausalLM"])  # (read as a llama config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError) as err:
        ModelConfig.from_pretrained(tmp_path)
    assert "unsupported architecture ['FalconForCausalLM']" in str(err.value)
    for arch in ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        assert arch in str(err.value)


@pytest.mark.parametrize("arch,sparse", [("qwen3moe", (False, True, False, True)),
                                         ("qwen2moe", (True, False, True)),
                                         ("mixtral", (True, True))])
def test_moe_layers_follow_the_config(arch, sparse, tiny_model_dir):
    moe = ModelConfig.from_pretrained(tiny_model_dir(arch)).moe
    assert moe.sparse_layers == sparse
    assert (moe.shared_expert_intermediate_size > 0) == (arch == "qwen2moe")


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseekv3", "deepseekv2"])
def test_weight_bytes_count_every_expert_and_projection(arch, tiny_model_dir):
    """What the memory check counts equals what the model holds (less biases and
    the latent attention's small norms)."""
    import torch

    from kvserve.engine.weights.loader import build_model
    from kvserve.modelstore.weight_bytes import weight_bytes

    cfg = ModelConfig.from_pretrained(tiny_model_dir(arch))
    model = build_model(cfg, torch.float32, torch.device("cpu"), 64)
    held = sum(p.numel() * 4 for name, p in model.named_parameters()
               if not name.endswith(("bias", "a_layernorm.weight")))
    assert weight_bytes(cfg, 4) == held


def test_random_weights_leave_every_norm_the_identity(tiny_model_dir):
    """--load-format random: RMSNorm weights 1, Gemma's (1 + w) ones 0."""
    import torch

    from kvserve.engine.weights.loader import build_model, init_random

    cfg = ModelConfig.from_pretrained(tiny_model_dir("gemma3"))
    model = build_model(cfg, torch.float32, torch.device("cpu"), 64)
    init_random(model, seed=0)
    assert torch.equal(model.norm.weight, torch.zeros_like(model.norm.weight))
    x = torch.randn(3, cfg.hidden_size)
    torch.testing.assert_close(model.norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                               + cfg.rms_norm_eps))

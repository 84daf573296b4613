"""Rotary tables (engine/models/rotary.py) against transformers' own rope functions,
for every scaling kvserve reads, and the context each scaling allows."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.config.model_config import ModelConfig, ModelConfigError
from kvserve.engine.config.rope_config import rope_from_hf, scaled_max_len
from kvserve.engine.models.rotary import RotaryEmbedding

HEAD_DIM = 32
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + i / 16 for i in range(HEAD_DIM // 2)],
                 "long_factor": [2.0 + i / 4 for i in range(HEAD_DIM // 2)]},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def hf_config(params: dict, max_pos: int = 256):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": 10000.0, **params})


def hf_table(cfg, rope_type: str, seq_len: int):
    """transformers' cos and sin [seq_len, dim / 2] for a sequence of seq_len tokens."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS.get(rope_type)
    inv_freq, scale = (init(cfg, "cpu", seq_len=seq_len) if init else
                       (1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)),
                        1.0))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    return freqs.cos() * scale, freqs.sin() * scale


@pytest.mark.parametrize("name", list(SCALINGS))
def test_tables_equal_transformers_inside_the_original_context(name):
    cfg = hf_config(SCALINGS[name])
    ours = RotaryEmbedding(HEAD_DIM, 256, rope_from_hf(cfg))
    seq_len = 60  # inside every original context: no dynamic rescaling yet
    cos, sin = hf_table(cfg, cfg.rope_parameters["rope_type"], seq_len)
    torch.testing.assert_close(ours.cos[:seq_len], cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin[:seq_len], sin, rtol=0, atol=1e-6)


def test_dynamic_ntk_rows_are_transformers_frequencies_at_that_length():
    cfg = hf_config(SCALINGS["dynamic"], max_pos=64)
    ours = RotaryEmbedding(HEAD_DIM, 200, rope_from_hf(cfg))
    for p in (63, 64, 100, 199):  # a token decoded at position p: the sequence is p + 1
        cos, sin = hf_table(cfg, "dynamic", p + 1)
        torch.testing.assert_close(ours.cos[p], cos[p], rtol=0, atol=1e-5)
        torch.testing.assert_close(ours.sin[p], sin[p], rtol=0, atol=1e-5)


def test_longrope_uses_the_long_factors_past_the_original_context():
    cfg = hf_config(SCALINGS["longrope"])
    ours = RotaryEmbedding(HEAD_DIM, 256, rope_from_hf(cfg))
    cos, _ = hf_table(cfg, "longrope", 200)  # a sequence past 64: the long factors
    torch.testing.assert_close(ours.cos[64:200], cos[64:200], rtol=0, atol=1e-5)


def test_partial_rotary_passes_the_other_dims_through():
    from kvserve.engine.models.rotary import apply_rotary

    cfg = hf_config({"rope_type": "default", "partial_rotary_factor": 0.5})
    rotary = RotaryEmbedding(HEAD_DIM, 16, rope_from_hf(cfg))
    x = torch.randn(5, 2, HEAD_DIM)
    out = apply_rotary(x, *rotary.table(torch.arange(5), x.dtype))
    assert torch.equal(out[..., HEAD_DIM // 2:], x[..., HEAD_DIM // 2:])
    assert not torch.equal(out[1:, :, :HEAD_DIM // 2], x[1:, :, :HEAD_DIM // 2])


def test_context_follows_the_scaling_as_vllm_derives_it():
    def max_len(params, max_pos=256):
        return scaled_max_len(max_pos, rope_from_hf(hf_config(params, max_pos)))

    assert max_len(SCALINGS["default"]) == 256
    assert max_len(SCALINGS["yarn"]) == 256  # 64 x 4: the config states it already
    assert max_len(SCALINGS["yarn"], max_pos=64) == 256  # 64 x 4: scaled here
    assert max_len(SCALINGS["linear"]) == 512
    assert max_len(SCALINGS["dynamic"]) == 512
    assert max_len(SCALINGS["llama3"]) == 256  # stated by the config
    assert max_len(SCALINGS["longrope"]) == 256


def test_unknown_scaling_is_a_config_error():
    cfg = hf_config({"rope_type": "default"})
    cfg.rope_parameters = {"rope_type": "no-such-rope", "rope_theta": 1.0}
    cfg.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ModelConfigError, match="unsupported rope_scaling type 'no-such-rope'"):
        ModelConfig.from_hf(cfg)

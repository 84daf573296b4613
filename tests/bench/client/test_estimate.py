"""The roofline calculator on Llama-3.1-8B and Llama-3.2-1B (numbers inline, so the
test does not depend on modelstore/presets)."""
from __future__ import annotations

import json

import pytest

from kvserve.benchmarks.client.estimate import efficiency, estimate
from kvserve.benchmarks.client.gpus import get_gpu
from kvserve.benchmarks.client.model_shape import ModelShape, config_path, load_shape
from kvserve.benchmarks.client.roofline import Setup

LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                vocab_size=128256, tie_word_embeddings=False)
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                vocab_size=128256, tie_word_embeddings=True)


def setup(cfg, gpu="h100", **kw) -> Setup:
    return Setup(ModelShape.from_config(cfg), get_gpu(gpu), **kw)


def test_llama_8b_sizes():
    shape = ModelShape.from_config(LLAMA_8B)
    assert shape.params() == 8_030_261_248  # the published 8.03B
    assert shape.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 131072
    assert setup(LLAMA_8B).weight_bytes == pytest.approx(16.06e9, rel=1e-3)


def test_llama_1b_sizes_tied():
    shape = ModelShape.from_config(LLAMA_1B)
    assert shape.params() == 1_235_814_400  # the published 1.24B
    assert shape.kv_bytes_per_token(2) == 2 * 16 * 8 * 64 * 2 == 32768


def test_head_dim_and_kv_heads_default_from_the_config():
    cfg = {k: v for k, v in LLAMA_8B.items() if k not in ("head_dim", "num_key_value_heads")}
    shape = ModelShape.from_config(cfg)
    assert shape.head_dim == 128 and shape.num_kv_heads == 32


def test_llama_8b_h100_batch_1_decode_ceiling_about_200_tok_s():
    e = estimate(setup(LLAMA_8B), batch=1, prompt_len=1024, output_len=512, price=3.0)
    # ~16 GB of weights over 3.35 TB/s; the untied input embedding is read one row at a
    # time, so a step reads 15.0 GB of weights plus 1280 tokens of KV.
    read = 8_030_261_248 * 2 - (128256 - 1) * 4096 * 2 + (1024 + 512 / 2) * 131072
    assert e["decode_tok_s_per_seq"] == pytest.approx(3.35e12 / read, rel=1e-3)
    assert 190 < e["decode_tok_s_per_seq"] < 230
    assert e["itl_ms"] == pytest.approx(1e3 / e["decode_tok_s_per_seq"])
    assert e["decode_bound"] == "memory" and e["prefill_bound"] == "compute"
    assert e["tokens_per_dollar"] == pytest.approx(e["decode_tok_s"] * 3600 / 3.0)


def test_kv_capacity_from_memory_left_after_weights():
    e = estimate(setup(LLAMA_8B), batch=1, prompt_len=1024, output_len=1024, price=1.0)
    budget = 80e9 * 0.9 - 8_030_261_248 * 2
    assert e["kv_budget_gb"] == pytest.approx(budget / 1e9)
    assert e["kv_capacity_tokens"] == int(budget // 131072)
    assert e["max_sequences"] == int(budget // (131072 * 2048)) == 208


@pytest.mark.parametrize("quantization, per_weight", [
    ("int8", 1.0), ("fp8", 1.0), ("int4", 0.5 + 4 / 32)])
def test_quantization_shrinks_the_projections_and_grows_the_kv_budget(quantization, per_weight):
    """The decoder projections take `per_weight` bytes (int4: plus a float16 scale and
    minimum per 32; int8: plus a bf16 scale per row, fp8 a float32 one, _scaled_mm's);
    embeddings, LM head and norms stay bf16."""
    shape = ModelShape.from_config(LLAMA_8B)
    tables = 2 * shape.embedding_params() + shape.hidden_size
    projections = shape.params() - tables - 2 * shape.hidden_size * shape.num_layers
    rows = shape.num_layers * (48 * 128 + 4096 + 2 * 14336 + 4096)  # qkv, o, gate_up, down
    scales = {"int8": 2, "fp8": 4, "int4": 0}[quantization] * rows
    expected = (tables + 2 * shape.hidden_size * shape.num_layers) * 2 \
        + projections * per_weight + scales
    quantized = setup(LLAMA_8B, quantization=quantization)
    assert quantized.weight_bytes == pytest.approx(expected, rel=1e-9)
    plain = estimate(setup(LLAMA_8B), batch=1, prompt_len=1024, output_len=1024, price=1.0)
    e = estimate(quantized, batch=1, prompt_len=1024, output_len=1024, price=1.0)
    assert e["kv_budget_gb"] - plain["kv_budget_gb"] == pytest.approx(
        (setup(LLAMA_8B).weight_bytes - expected) / 1e9)
    assert e["itl_ms"] < plain["itl_ms"]


def test_prefill_is_two_flops_per_weight_per_token_plus_attention():
    s = setup(LLAMA_8B)
    e = estimate(s, batch=1, prompt_len=1000, output_len=10, price=1.0)
    matmul = 2 * (32 * s.shape.layer_params() + 128256 * 4096) * 1000
    attention = 4 * 32 * 32 * 128 * 1000 * 500
    assert e["ttft_ms"] == pytest.approx((matmul + attention) / 989e12 * 1e3)


def test_big_batches_turn_compute_bound_and_aggregate_grows():
    s = setup(LLAMA_1B)
    small = estimate(s, batch=1, prompt_len=128, output_len=128, price=1.0)
    big = estimate(s, batch=4096, prompt_len=128, output_len=128, price=1.0)
    assert big["decode_tok_s"] > 50 * small["decode_tok_s"]
    assert big["decode_bound"] == "compute"


def test_calibration_scales_by_measured_efficiency():
    full = estimate(setup(LLAMA_8B), 1, 1024, 512, 1.0)
    half = estimate(setup(LLAMA_8B, mbu=0.5), 1, 1024, 512, 1.0)
    assert half["decode_tok_s"] == pytest.approx(full["decode_tok_s"] / 2)
    assert efficiency({"decode": {"mbu": 0.62}}, "mbu") == 0.62  # found when nested
    assert efficiency({"runs": [{"x": 1}, {"mbu": 71}]}, "mbu") == pytest.approx(0.71)
    assert efficiency({}, "mbu") == 1.0


def test_config_paths_and_presets(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_1B))
    assert load_shape(str(tmp_path)).hidden_size == 2048  # a model directory
    assert load_shape(str(tmp_path / "config.json")).num_layers == 16
    with pytest.raises(FileNotFoundError, match="no such preset"):
        config_path("no-such-model")


def test_preset_names_resolve_when_shipped():
    try:
        path = config_path("llama-3.1-8b")
    except FileNotFoundError:
        pytest.skip("modelstore/presets/llama-3.1-8b is not there")
    assert load_shape(str(path)) == ModelShape.from_config(LLAMA_8B)
    assert config_path("preset:llama-3.1-8b") == path


def test_unknown_gpu():
    with pytest.raises(ValueError, match="unknown GPU"):
        get_gpu("tpu")
    assert get_gpu("H100").bandwidth_tb_s == 3.35 and get_gpu("RTX-4090").memory_gb == 24

"""--load-format gguf: a GGUF's Q4_0 / Q4_1 / Q8_0 projections repacked into our int4 /
group-int8 layers bit-exactly (their de-quantized weights equal gguf's own
de-quantization), llama.cpp's query/key permutation undone, other types expanded,
and the shipped default model's Q4_1 file equal to the float weights it was
converted into."""
from __future__ import annotations

from dataclasses import replace

import gguf
import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.models.quantized.int4 import Int4Linear
from kvserve.engine.models.quantized.int8 import GroupInt8Linear
from kvserve.engine.weights.loader import load_model
from kvserve.modelstore.errors import ModelLoadError
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.tiny_gguf import INT4_SHAPES, write_gguf_dir
from tests.support.tiny_models import make_tiny_model

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-int4-shapes"), **INT4_SHAPES)


@pytest.fixture(scope="module")
def gguf_dir(float_dir, tmp_path_factory):
    """make(type for the projections, type for everything else 2-D) -> a directory."""
    made = {}

    def make(projections, rest=T.F16):
        key = (projections, rest)
        if key not in made:
            made[key] = write_gguf_dir(
                float_dir, tmp_path_factory.mktemp(f"gguf-{projections.name}"),
                lambda name: projections if name.startswith("blk.") else rest)
        return made[key]
    return make


def _load(model_dir, quantization, dtype=torch.float32):
    cfg = ModelConfig.from_pretrained(model_dir)
    return load_model(model_dir, cfg, dtype, CPU, 256, "gguf", 0, quantization)


def _weights(model) -> dict[str, torch.Tensor]:
    """Every projection's weight as fp32 [N, K], quantized layers de-quantized."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            out[name] = m.dequantized_t(torch.float32).t()
        elif isinstance(m, GroupInt8Linear):
            out[name] = m.dequantized(torch.float32)
        elif isinstance(m, torch.nn.Linear) and name.startswith("layers."):
            out[name] = m.weight.float()
    return out


@pytest.mark.parametrize("kind, layer", [(T.Q4_0, Int4Linear), (T.Q4_1, Int4Linear),
                                         (T.Q8_0, GroupInt8Linear)])
def test_repacked_blocks_equal_ggufs_own_dequantization(gguf_dir, kind, layer):
    model_dir = gguf_dir(kind)
    kept, expanded = _load(model_dir, "auto"), _load(model_dir, "none")
    quantized = [m for m in kept.modules() if isinstance(m, layer)]
    assert len(quantized) == 4 * kept.config.num_layers
    assert not any(isinstance(m, layer) for m in expanded.modules())
    a, b = _weights(kept), _weights(expanded)
    assert a.keys() == b.keys()
    for name in a:  # none expands through gguf.quants.dequantize: bit for bit
        assert torch.equal(a[name], b[name]), name


def test_the_query_key_permutation_is_undone(float_dir, gguf_dir):
    """F16 everywhere: every weight is the checkpoint's, rounded to fp16 only."""
    from safetensors.torch import load_file

    model = _load(gguf_dir(T.F16), "auto")
    original = load_file(str(float_dir / "model.safetensors"))
    q = model.layers[1].self_attn.qkv_proj.weight
    qs, ks = INT4_SHAPES["hidden_size"], 64
    for part, hf in [(q[:qs], "q_proj"), (q[qs:qs + ks], "k_proj"), (q[qs + ks:], "v_proj")]:
        expected = original[f"model.layers.1.self_attn.{hf}.weight"].half().float()
        assert torch.equal(part, expected), hf


def test_a_type_without_a_layer_of_ours_is_expanded(gguf_dir, caplog):
    caplog.set_level("INFO", logger="kvserve.loader")
    model = _load(gguf_dir(T.Q5_0), "auto")
    assert not any(isinstance(m, (Int4Linear, GroupInt8Linear)) for m in model.modules())
    assert "expanded to floats: 14 Q5_0" in caplog.text


def test_int4_layers_agree_with_their_expansion_in_the_engine(gguf_dir):
    """Same weights both ways (int4 kernel or expanded per call vs floats): the
    logprobs of a prompt agree closely in bf16, and greedy tokens in fp32."""
    model_dir = str(gguf_dir(T.Q4_1))
    prompt = [[5, 17, 42, 99, 7, 3, 250, 11]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = [Engine(EngineConfig(model=model_dir, load_format="gguf", quantization=q,
                                   dtype="float32", num_kv_blocks=64)).generate(prompt, params)
               for q in ("auto", "none")]
    assert outputs[0] == outputs[1]


def test_a_gguf_file_alone_is_a_model(gguf_dir, tmp_path):
    """--model path/to/model.gguf: config and tokenizer from the file's metadata,
    --load-format auto picks gguf; the same model as the directory it came from."""
    import shutil

    model_dir = gguf_dir(T.Q4_1)
    alone = shutil.copy(model_dir / "model.gguf", tmp_path / "model.gguf")
    from_file = Engine(EngineConfig(model=str(alone), dtype="float32", num_kv_blocks=64))
    from_dir = Engine(EngineConfig(model=str(model_dir), load_format="gguf",
                                   dtype="float32", num_kv_blocks=64))
    # (a GGUF does not say which dtype its float tensors came from)
    assert replace(from_file.model_config, torch_dtype=None) == \
        replace(from_dir.model_config, torch_dtype=None)
    text = "The capital of France is Paris."
    assert from_file.tokenizer.encode(text) == from_dir.tokenizer.encode(text)
    assert from_file.tokenizer.chat_template == from_dir.tokenizer.chat_template
    prompt = [from_dir.tokenizer.encode(text)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert from_file.generate(prompt, params) == from_dir.generate(prompt, params)


def test_load_format_auto_prefers_safetensors_and_finds_a_lone_gguf(float_dir, gguf_dir):
    from kvserve.engine.weights.loader import resolve_load_format

    assert resolve_load_format(float_dir, "auto") == "safetensors"
    assert resolve_load_format(gguf_dir(T.Q4_1), "auto") == "gguf"
    assert resolve_load_format(gguf_dir(T.Q4_1) / "model.gguf", "auto") == "gguf"
    assert resolve_load_format("preset:llama-tiny", "auto") == "safetensors"


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantizing_a_gguf_again_is_refused_with_what_works(gguf_dir, quantization):
    with pytest.raises(ModelLoadError, match="--quantization auto .* or none"):
        _load(gguf_dir(T.Q4_1), quantization)


def test_a_directory_without_one_gguf_file_is_refused(float_dir):
    with pytest.raises(ModelLoadError, match="exactly one \\*.gguf file"):
        _load(float_dir, "auto")


def test_an_architecture_other_than_llama_is_refused(float_dir, tmp_path):
    model_dir = write_gguf_dir(float_dir, tmp_path / "gemma", lambda name: T.F16, "gemma")
    with pytest.raises(ModelLoadError, match="'gemma' is not supported"):
        _load(model_dir, "auto")


def test_the_shipped_q4_1_file_is_the_float_model_it_was_converted_into(default_model_dir):
    """The default model's safetensors are transformers' expansion of the same file:
    expanded by us they are equal bit for bit, and its int4 layers hold exactly
    those weights in a third of the bytes."""
    from kvserve.engine.weights.quantization import model_bytes

    cfg = ModelConfig.from_pretrained(default_model_dir)
    float_model = load_model(default_model_dir, cfg, torch.float32, CPU, 256)
    expanded, kept = _load(default_model_dir, "none"), _load(default_model_dir, "auto")
    reference = dict(float_model.named_parameters())
    for name, p in expanded.named_parameters():
        assert torch.equal(p, reference[name]), name
    kept_weights = _weights(kept)
    assert len([m for m in kept.modules() if isinstance(m, Int4Linear)]) == 4 * cfg.num_layers
    for name, w in kept_weights.items():
        assert torch.equal(w, reference[f"{name}.weight"]), name
    assert model_bytes(kept) < 0.35 * model_bytes(float_model)

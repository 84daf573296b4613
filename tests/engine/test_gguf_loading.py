"""--load-format gguf: a GGUF's quantized projections (Q4_0/Q4_1/Q8_0, the K-quant
mixes llama-quantize writes, IQ4) repacked into our int4 / group-int8 layers and its
vocabulary into quantized tables bit-exactly (their de-quantized weights equal gguf's
own de-quantization), llama.cpp's query/key permutation undone, other types
expanded, resident bytes near the file's, and the shipped default model's Q4_1 file
equal to the float weights it was converted into."""
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
from kvserve.engine.models.quantized.stacked import StackedLinear
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.models.quantized.table import QuantizedEmbedding
from kvserve.engine.weights.loader import load_model
from kvserve.modelstore.errors import ModelLoadError
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.greedy_close import assert_greedy_close, greedy_with_logprobs
from tests.support.tiny_gguf import INT4_SHAPES, K_QUANT_SHAPES, write_gguf_dir
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
    return {name: _weights_of(m) for name, m in model.named_modules()
            if name.startswith("layers.") and name.count(".") == 3 and isinstance(
                m, (Int4Linear, GroupInt8Linear, StackedLinear, torch.nn.Linear))}


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


def test_a_type_without_a_layer_of_ours_is_expanded(float_dir, tmp_path, caplog):
    """TQ2_0 (ternary, blocks of 256: the down projections' 256 inputs) has no
    layer of ours: expanded, and said so; the Q8_0 around it is kept."""
    caplog.set_level("INFO", logger="kvserve.loader")
    model_dir = write_gguf_dir(float_dir, tmp_path / "tq2", lambda name: (
        T.TQ2_0 if "ffn_down" in name else T.Q8_0 if name.startswith("blk.") else T.F16))
    model = _load(model_dir, "auto")
    assert all(layer.mlp.down_proj.weight.dtype == torch.float32 for layer in model.layers)
    assert all(isinstance(layer.mlp.gate_up_proj, GroupInt8Linear) for layer in model.layers)
    assert "expanded to floats: 2 TQ2_0" in caplog.text


@pytest.mark.parametrize("kind", [T.Q4_1, T.Q4_0])
def test_int4_layers_agree_with_their_expansion_in_the_engine(gguf_dir, kind):
    """Same weights both ways (int4 kernel or expanded per call vs floats), fp32
    greedy. With float32 inputs the kernel's outputs are the expansion's; as shipped
    it rounds a GGUF's inputs to int8 for its integer products (as llama.cpp does),
    which moves this random model's logprobs up to 0.2 nats (measured on an
    AVX2-only Zen 3), so its tokens agree up to a near-tie (one splits at the 9th
    token there, 0.02 nats apart). Q4_0's symmetric blocks are packed without
    minimums where kvserve's kernels run."""
    model_dir = str(gguf_dir(kind))
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    engines = [Engine(EngineConfig(model=model_dir, load_format="gguf", quantization=q,
                                   dtype="float32", num_kv_blocks=64)) for q in ("auto", "none")]
    kernel, floats = (greedy_with_logprobs(engine, prompt, 16) for engine in engines)
    assert assert_greedy_close(kernel, floats, atol=0.3) >= 4
    packed = [m.packed for m in engines[0].runner.model.modules()
              if isinstance(m, Int4Linear) and getattr(m, "packed", None) is not None]
    assert packed or not {"avx2", "fma", "f16c"} <= cpu_flags()  # where the kernels run
    assert all((p.mins is None) == (kind == T.Q4_0) for p in packed)
    for weight in packed:
        weight.int8_inputs = False
    exact = greedy_with_logprobs(engines[0], prompt, 16)
    assert assert_greedy_close(exact, floats, atol=1e-3) == 16


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


# The mixes llama-quantize writes (llama_tensor_get_type): most projections in the
# named type, the value and down projections (some layers) and the head a size up.
def _q4_k_m(name: str):
    if "attn_v" in name or name == "output.weight" or name == "blk.0.ffn_down.weight":
        return T.Q6_K
    return T.Q4_K


def _q5_k_m(name: str):
    return T.Q6_K if "attn_v" in name or "ffn_down" in name else T.Q5_K


def _q3_k_m(name: str):
    return T.Q5_K if "attn_v" in name else T.Q4_K if "ffn_down" in name else T.Q3_K


MIXES = {"Q4_K_M": _q4_k_m, "Q5_K_M": _q5_k_m, "Q3_K_M": _q3_k_m,
         "Q2_K": lambda name: T.Q4_K if "attn_v" in name else T.Q2_K,
         "IQ4_XS": lambda name: T.IQ4_XS, "IQ4_NL": lambda name: T.IQ4_NL}


def _head_type(mix: str) -> str:
    return MIXES[mix]("output.weight").name


@pytest.fixture(scope="module")
def k_quant_dir(tmp_path_factory):
    float_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-k-quant-shapes"), **K_QUANT_SHAPES)
    made = {}

    def make(mix: str, tied: bool = False):
        if (mix, tied) not in made:
            source = float_dir
            if tied:
                source = make_tiny_model(tmp_path_factory.mktemp("tiny-k-tied"),
                                         tie_word_embeddings=True, **K_QUANT_SHAPES)
            made[mix, tied] = write_gguf_dir(source, tmp_path_factory.mktemp(f"gguf-{mix}"),
                                             MIXES[mix])
        return made[mix, tied]
    return make


def _vocabulary(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding table and the head's weight, de-quantized where kept."""
    embed = model.embed_tokens
    table = embed.table.dequantized(torch.float32) if isinstance(embed, QuantizedEmbedding) \
        else embed.weight
    return table, _weights_of(model.lm_head)


def _weights_of(layer) -> torch.Tensor:
    if isinstance(layer, StackedLinear):
        return torch.cat([_weights_of(part) for part in layer.parts])
    if isinstance(layer, Int4Linear):
        return layer.dequantized_t(torch.float32).t()
    if isinstance(layer, GroupInt8Linear):
        return layer.dequantized(torch.float32)
    return layer.weight.float()


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_k_quant_mixes_are_kept_quantized_value_for_value(k_quant_dir, mix, caplog):
    """Every projection and the embedding table stay in the file's blocks (int4
    where the codes are 16, else a byte each) and hold exactly gguf's own
    de-quantization of them (the float32 head is read as floats: no kernel)."""
    caplog.set_level("INFO", logger="kvserve.loader")
    model_dir = k_quant_dir(mix)
    kept, expanded = _load(model_dir, "auto"), _load(model_dir, "none")
    quantized = (Int4Linear, GroupInt8Linear, StackedLinear)
    for layer in kept.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                     layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(proj, quantized)
    assert isinstance(kept.embed_tokens, QuantizedEmbedding)  # untied
    a, b = _weights(kept), _weights(expanded)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for ours, theirs in zip(_vocabulary(kept), _vocabulary(expanded)):
        assert torch.equal(ours, theirs)
    assert f"expanded to floats: 1 {_head_type(mix)}" in caplog.text


def test_a_q4_k_m_file_keeps_its_int4_where_every_shard_is_4_bit(k_quant_dir):
    model = _load(k_quant_dir("Q4_K_M"), "auto")
    first, second = model.layers
    assert isinstance(first.mlp.gate_up_proj, Int4Linear)  # Q4_K + Q4_K
    qkv = first.self_attn.qkv_proj  # Q4_K, Q4_K, Q6_K: two int4 layers and an int8 one
    assert [type(p) for p in qkv.parts] == [Int4Linear, Int4Linear, GroupInt8Linear]
    assert isinstance(first.mlp.down_proj, GroupInt8Linear)  # Q6_K
    assert isinstance(second.mlp.down_proj, Int4Linear)  # Q4_K
    gate_up = first.mlp.gate_up_proj  # d * sc as its two float16 factors
    assert gate_up.scales.dtype == gate_up.scale_base.dtype == torch.float16
    assert model.embed_tokens.table.nibbles


@pytest.mark.parametrize("mix, most", [("Q4_K_M", 1.3), ("Q5_K_M", 1.65), ("IQ4_XS", 1.2),
                                       ("IQ4_NL", 1.15)])
def test_resident_weights_stay_near_the_files_tensor_bytes(k_quant_dir, mix, most):
    """Resident bytes against what the file's tensors take, the LM head left out on
    both sides (read as floats where no kernel reads it, above): within `most` times
    (4-bit codes two to a byte with float16 group scales, the K-quants' as two
    factors; 5- and 6-bit codes a byte each), where bfloat16 takes 2.8-3.5 times."""
    from kvserve.engine.platform.gguf_checkpoint import GGUFCheckpoint
    from kvserve.engine.weights.quantization import resident_bytes

    model_dir = k_quant_dir(mix)
    ckpt = GGUFCheckpoint(model_dir / "model.gguf")
    file_bytes = ckpt.tensor_bytes() - int(ckpt.tensors["output.weight"].n_bytes)

    def without_head(model) -> int:
        head = sum(t.numel() * t.element_size() for t in model.lm_head.parameters())
        return resident_bytes(model) - head

    kept = without_head(_load(model_dir, "auto"))  # (bf16 adds torch's int4 kernel's scales)
    as_bf16 = without_head(_load(model_dir, "none", torch.bfloat16))
    assert kept <= most * file_bytes, (kept, file_bytes)
    assert as_bf16 > 2.5 * file_bytes and kept < 0.7 * as_bf16


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_stays_quantized_only_where_a_kernel_reads_it(k_quant_dir, tied):
    """bf16 on CPU: a Q4_K head (the tied table's) is an int4 layer torch's kernel
    reads; a Q6_K one has no kernel here, and float32 none at all: read as floats
    (expanded every step it would cost more than it saves). An untied table stays
    quantized either way, its rows the file's; a tied one with a float head is
    that head's weight (one copy)."""
    model_dir = k_quant_dir("Q4_K_M", tied)
    bf16, fp32 = _load(model_dir, "auto", torch.bfloat16), _load(model_dir, "auto")
    assert isinstance(bf16.lm_head, Int4Linear if tied else torch.nn.Linear)
    assert isinstance(bf16.embed_tokens, QuantizedEmbedding)
    assert isinstance(fp32.lm_head, torch.nn.Linear) and fp32.lm_head.weight.dtype == torch.float32
    reference = _load(model_dir, "none")
    table = reference.embed_tokens.weight
    if tied:
        assert fp32.lm_head.weight is fp32.embed_tokens.weight
        assert torch.equal(fp32.lm_head.weight, table)
        assert torch.equal(_weights_of(bf16.lm_head), table)
    else:
        ids = torch.tensor([[3, 17, 250]])
        assert torch.equal(fp32.embed_tokens(ids)[0], table[ids[0]])
        assert torch.equal(fp32.lm_head.weight, reference.lm_head.weight)


@pytest.mark.parametrize("mix, tied", [("Q4_K_M", False), ("Q4_K_M", True), ("Q5_K_M", False)])
def test_k_quant_models_generate_as_their_expansion(k_quant_dir, mix, tied):
    """The engine on the kept blocks and on their float expansion: same greedy
    tokens in float32, through chunked prefill and a prefix hit."""
    model_dir = str(k_quant_dir(mix, tied))
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11] * 5, [5, 17, 42, 99, 7, 3, 250, 11] * 4 + [9]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = [Engine(EngineConfig(model=model_dir, load_format="gguf", quantization=q,
                                   dtype="float32", num_kv_blocks=64,
                                   max_num_batched_tokens=16)).generate(prompts, params)
               for q in ("auto", "none")]
    assert outputs[0] == outputs[1]


def test_a_k_quant_model_compiles_and_generates_as_its_expansion(k_quant_dir):
    """The compiled CPU path over int4, stacked and codebook layers and the quantized
    table: the same greedy tokens as the eager expansion."""
    model_dir = str(k_quant_dir("Q4_K_M", tied=True))
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11] * 3, [9, 8, 7]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    compiled = Engine(EngineConfig(model=model_dir, load_format="gguf", dtype="float32",
                                   num_kv_blocks=64, compile="wait"))
    assert compiled.runner.compiled is not None
    got = compiled.generate(prompts[:1], params) + compiled.generate(prompts[1:], params)
    eager = Engine(EngineConfig(model=model_dir, load_format="gguf", quantization="none",
                                dtype="float32", num_kv_blocks=64))
    assert got == eager.generate(prompts[:1], params) + eager.generate(prompts[1:], params)


@pytest.mark.parametrize("arch, extra", [("qwen2", {}), ("qwen3", {"head_dim": 64})])
def test_qwen_gguf_files_serve_as_transformers_computes_them(arch, extra, tmp_path):
    """A qwen2 (q/k/v biases) or qwen3 (QK-norm) GGUF, as llama.cpp writes them
    (unpermuted): in F32 alone (config and tokenizer from its metadata) greedy
    equals transformers on the checkpoint it came from; with a Q4_K_M mix its
    projections are kept quantized, biases kept, and greedy equals its expansion."""
    from tests.support.reference import load_reference, reference_greedy

    float_dir = make_tiny_model(tmp_path / "hf", arch, **K_QUANT_SHAPES, **extra)
    exact = write_gguf_dir(float_dir, tmp_path / "f32", lambda name: T.F32, arch)
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11] * 3, [9, 8, 7]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(exact / "model.gguf"), dtype="float32",
                                 num_kv_blocks=64, max_num_batched_tokens=16))
    assert engine.model_config.architecture == f"{arch.capitalize()}ForCausalLM"
    ref = load_reference(float_dir)
    assert engine.generate(prompts, params) == [reference_greedy(ref, p, 10) for p in prompts]

    mixed = write_gguf_dir(float_dir, tmp_path / "q4km", _q4_k_m, arch)
    kept = _load(mixed, "auto")
    qkv = kept.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, StackedLinear)
    if arch == "qwen2":
        assert all(part.bias is not None for part in qkv.parts)
    outputs = [Engine(EngineConfig(model=str(mixed), load_format="gguf", quantization=q,
                                   dtype="float32", num_kv_blocks=64)).generate(prompts, params)
               for q in ("auto", "none")]
    assert outputs[0] == outputs[1]

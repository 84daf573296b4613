"""A GGUF's Q8_0 LM head (the tied table's, as in the shipped default model's Q4_1
file, or an untied output.weight) kept in its blocks where kvserve's CPU GEMM packs
the quantized layers: int8 panels read in place of the head expanded to floats, its
logits the file's Q8_0 product, the table looked up from the file's blocks, the same
greedy tokens chunked or whole."""
from __future__ import annotations

import gguf
import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.models.quantized.int8 import GroupInt8Linear
from kvserve.engine.models.quantized.table import QuantizedEmbedding
from kvserve.engine.kernels.cpu.packing import reference_product, unpack_weight
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.kernels.cpu import build
from kvserve.engine.weights import cpu_packing
from kvserve.engine.weights.cpu_packing import NEEDED_FLAGS, pack_model
from kvserve.engine.weights.loader import load_model
from kvserve.scheduler.sampling_params import SamplingParams
from tests.support.tiny_gguf import INT4_SHAPES, write_gguf_dir
from tests.support.tiny_models import make_tiny_model

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(not set(NEEDED_FLAGS) <= cpu_flags(),
                                   reason="kvserve's CPU kernels need AVX2, FMA and F16C")


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def q8_head_dir(request, tmp_path_factory):
    """Q8_0 table and head, F16 projections: float32 layers whose products do not
    depend on a step's rows on any CPU (the int4 ones' do on AVX2, where integer
    products stop at 12 rows), so what differs between steps is the head's alone."""
    tied = request.param
    float_dir = make_tiny_model(tmp_path_factory.mktemp("float"), tie_word_embeddings=tied,
                                **INT4_SHAPES)
    return write_gguf_dir(float_dir, tmp_path_factory.mktemp("gguf"), lambda name: (
        T.F16 if name.startswith("blk.") else T.Q8_0)), tied


def _load(model_dir, quantization="auto", panels_here=False):
    cfg = ModelConfig.from_pretrained(model_dir)
    return load_model(model_dir, cfg, torch.float32, CPU, 256, "gguf", 0, quantization,
                      panels_here=panels_here)


def test_the_q8_0_head_is_kept_only_where_the_panels_read_it(q8_head_dir):
    model_dir, tied = q8_head_dir
    kept, floats = _load(model_dir, panels_here=True), _load(model_dir)
    expanded = _load(model_dir, "none")
    assert isinstance(kept.lm_head, GroupInt8Linear) and kept.lm_head.fits_panels()
    assert isinstance(kept.embed_tokens, QuantizedEmbedding)
    # its values are the file's, bit for bit, and so are the table's rows
    assert torch.equal(kept.lm_head.dequantized(torch.float32), expanded.lm_head.weight)
    ids = torch.tensor([[3, 17, 250]])
    assert torch.equal(kept.embed_tokens(ids), expanded.embed_tokens(ids))
    # without the panels a Q8_0 head would be expanded every step: read as floats
    assert isinstance(floats.lm_head, torch.nn.Linear)
    assert torch.equal(floats.lm_head.weight, expanded.lm_head.weight)
    if tied:  # one copy; an untied table stays in its blocks either way
        assert floats.lm_head.weight is floats.embed_tokens.weight
    else:
        assert isinstance(floats.embed_tokens, QuantizedEmbedding)


@needs_kernels
def test_the_packed_head_computes_the_files_q8_0_product(q8_head_dir):
    """Packed, the head reads the file's Q8_0 values and takes x quantized to int8
    where the kernel takes integer products (takes_dots), as llama.cpp's Q8_0 dot
    product does: its logits are reference_product's."""
    model_dir, _ = q8_head_dir
    model = _load(model_dir, panels_here=True)
    values = model.lm_head.dequantized(torch.float32)
    assert pack_model(model, "kvserve", CPU, torch.float32) == 4 * model.config.num_layers + 1
    head = model.lm_head.packed
    assert head.panels.dtype == torch.int8 and head.scales.dtype == torch.float16
    vocab = model.config.vocab_size
    assert torch.equal(unpack_weight(head.contents(), vocab), values)
    x = torch.randn(5, model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(x).double(),
                                   reference_product(x, head.contents(), vocab, True),
                                   rtol=1e-5, atol=1e-5)


@needs_kernels
def test_the_engine_serves_the_kept_head_the_same_chunked_or_whole(q8_head_dir):
    """The engine on the packed head (kvserve's kernels, float32): the same greedy
    tokens through chunked prefill, a prefix hit and preemption as in whole-prompt
    steps, and close to the expansion's logits (x's int8 rounding apart)."""
    model_dir, _ = q8_head_dir
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11] * 5, [5, 17, 42, 99, 7, 3, 250, 11] * 4 + [9]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def engine(quantization, budget, blocks=64):
        return Engine(EngineConfig(model=str(model_dir), load_format="gguf", dtype="float32",
                                   quantization=quantization, cpu_kernels="kvserve",
                                   num_kv_blocks=blocks, max_num_batched_tokens=budget))

    chunked, whole = engine("auto", 16), engine("auto", 2048)
    assert isinstance(chunked.runner.model.lm_head, GroupInt8Linear)
    assert chunked.runner.model.lm_head.packed is not None
    expected = whole.generate(prompts, params)
    assert chunked.generate(prompts, params) == expected
    tight = engine("auto", 16, blocks=4)  # 4 and 3 blocks at the end, 2 shared: one waits
    assert tight.generate(prompts, params) == expected
    assert tight.scheduler.num_preemptions > 0
    hidden = torch.randn(4, chunked.runner.model.config.hidden_size)
    with torch.inference_mode():
        kept = chunked.runner.model.compute_logits(hidden)
        floats = engine("none", 2048).runner.model.compute_logits(hidden)
    assert (kept - floats).norm() / floats.norm() < 0.02


def test_the_head_is_kept_for_the_panels_only_where_the_kernels_load(monkeypatch):
    """A failed build leaves torch's GEMMs under auto: a head kept for the panels
    would then be expanded every step, so the loader is told not to keep it."""
    flags = set(NEEDED_FLAGS)
    monkeypatch.setattr(cpu_packing, "load_once", lambda: None)
    assert cpu_packing.quantized_panels_here("kvserve", CPU, torch.float32, flags)
    assert not cpu_packing.quantized_panels_here("torch", CPU, torch.float32, flags)
    assert not cpu_packing.quantized_panels_here("auto", CPU, torch.bfloat16, set())

    def fail():
        raise build.BuildError("no C++ compiler found (g++ or $CXX)")

    monkeypatch.setattr(cpu_packing, "load_once", fail)
    assert not cpu_packing.quantized_panels_here("auto", CPU, torch.bfloat16, flags)
    assert not cpu_packing.quantized_panels_here("kvserve", CPU, torch.float32, flags)

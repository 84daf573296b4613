"""GGUF files of the families past Llama/Qwen2/Qwen3, laid out as llama.cpp's
converter writes them: mixtures of experts (qwen2moe, qwen3moe, Mixtral's `llama`
with experts: each layer's experts stacked into [E, N, K] tensors, the router,
Qwen2-MoE's shared expert and its gate) and Gemma 2 / 3 (four norms a layer written
as 1 + w, windows, soft-caps, Gemma 3's pattern of sliding layers and two rope
bases in the metadata) and Phi-3 (q/k/v and gate/up fused, longrope factors as
tensors). In F32 a file alone (config from its metadata) computes what
transformers computes on the checkpoint it came from; with a K-quant mix the
projections and experts stay in their blocks (experts: int8 values or 4-bit codes,
group scales and minimums) value for value, and the engine generates what their
expansion does, eagerly and compiled."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.config.model_config import ModelConfig
from kvserve.engine.core.engine import Engine
from kvserve.engine.kernels.group_quant import group_weights
from kvserve.engine.models.moe import FusedExperts
from kvserve.engine.weights.quantization import resident_bytes
from tests.support.gguf_families import ARCHITECTURES, GREEDY, MOE, PROMPTS, T, load
from tests.support.gguf_families import family, moe  # noqa: F401  (fixtures)
from tests.support.tiny_gguf import K_QUANT_SHAPES, write_gguf_dir
from tests.support.tiny_models import make_tiny_model


def test_a_gguf_alone_computes_what_transformers_does(family):
    """Chunked prefill over prompts longer than the windows, a prefix hit."""
    from tests.support.reference import load_reference, reference_greedy

    arch, float_dir, exact, _ = family
    engine = Engine(EngineConfig(model=str(exact / "model.gguf"), dtype="float32",
                                 num_kv_blocks=64, max_num_batched_tokens=16))
    cfg = engine.model_config
    assert cfg.architecture == ARCHITECTURES[arch]
    if arch in MOE:
        assert cfg.moe.num_experts == 6
        assert cfg.moe.norm_topk_prob == (arch != "qwen2moe")  # llama.cpp's norm_w
    ref = load_reference(float_dir)
    assert engine.generate(PROMPTS, GREEDY) == [reference_greedy(ref, p, 10) for p in PROMPTS]


def test_a_gguf_beside_its_config_is_the_same_model(family):
    """A directory holding config.json, the tokenizer and the file: the config
    read from the metadata is the checkpoint's own, for what the model computes."""
    from dataclasses import replace

    _, _, exact, _ = family
    from_file = ModelConfig.from_pretrained(exact / "model.gguf")
    from_dir = ModelConfig.from_pretrained(exact)
    # (a GGUF does not say which dtype its float tensors came from)
    assert replace(from_file, torch_dtype=None) == replace(from_dir, torch_dtype=None)


def test_k_quant_experts_stay_in_their_blocks_value_for_value(moe, caplog):
    """Q4_K gate/up experts: codes two to a byte, a scale and minimum per 32 inputs;
    Q6_K down experts: a byte each, a scale per 16; gpt-oss's MXFP4: codebook values
    a byte each, a power of two per 32 (and its experts' biases as they were)."""
    caplog.set_level("INFO", logger="kvserve.loader")
    arch, _, _, mixed = moe
    kept, expanded = load(mixed, "auto"), load(mixed, "none")
    floats = dict(expanded.named_modules())
    experts = [(a, floats[n]) for n, a in kept.named_modules() if isinstance(a, FusedExperts)]
    assert len(experts) == kept.config.num_layers
    mxfp4 = arch == "gptoss"
    for a, b in experts:
        assert (a.w13.dtype, a.w2.dtype) == ((torch.int8, torch.int8) if mxfp4
                                             else (torch.uint8, torch.int8))
        assert a.w13.shape[-1] * (1 if mxfp4 else 2) == b.w13.shape[-1]
        assert a.w2.shape == b.w2.shape
        assert a.w13_scale.shape[-1] == 256 // 32
        assert a.w2_scale.shape[-1] == 256 // (32 if mxfp4 else 16)
        assert (a.w13_min is None) == mxfp4 and a.w2_min is None
        for name in ("w13", "w2"):
            q, scale, low = (getattr(a, f"{name}{s}") for s in ("", "_scale", "_min"))
            assert torch.equal(group_weights(q, scale, low, torch.float32),
                               getattr(b, name)), name
        if mxfp4:
            assert torch.equal(a.b13, b.b13) and torch.equal(a.b2, b.b2)
    assert ("experts MXFP4" if mxfp4 else "experts Q4_K+Q6_K") in caplog.text
    # Half a byte or a byte a weight and a float32 scale (and minimum) per group,
    # against 4 bytes.
    assert resident_bytes(kept) < 0.35 * resident_bytes(expanded)


def test_a_windowed_mistral_gguf_takes_its_window_from_the_config_beside_it(tmp_path):
    """llama.cpp writes Mistral as a `llama` file with no window: beside its
    config.json the window holds, and greedy equals transformers over prompts
    longer than it (with its blocks dropped as the window passes them)."""
    from tests.support.reference import load_reference, reference_greedy

    float_dir = make_tiny_model(tmp_path / "hf", "mistralwin", **K_QUANT_SHAPES)
    gguf_dir = write_gguf_dir(float_dir, tmp_path / "f32", lambda n: T.F32, "llama")
    engine = Engine(EngineConfig(model=str(gguf_dir), load_format="gguf", dtype="float32",
                                 num_kv_blocks=64, max_num_batched_tokens=16))
    assert engine.model_config.sliding_window == 24
    ref = load_reference(float_dir)
    assert engine.generate(PROMPTS, GREEDY) == [reference_greedy(ref, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("packed", [False, True], ids=["bytes", "nibbles"])
def test_group_quantized_experts_equal_their_float_expansion(tokens, packed):
    """The op (and, for one token, the compiled graph's plain-ops form) on group
    scales and minimums, codes a byte each or two to a byte: what float experts
    holding the expanded weights compute."""
    from kvserve.engine.kernels.moe.fused_experts import fused_experts, one_token_experts

    g = torch.Generator().manual_seed(0)
    E, H, I, G = 4, 64, 32, 4  # noqa: N806
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)

    def codes(n, k):
        q = torch.randint(0, 16, (E, n, k), generator=g, dtype=torch.uint8)
        return (q[..., 0::2] | (q[..., 1::2] << 4)) if packed else q.to(torch.int8)

    def groups(n, groups_of):
        return torch.rand(E, n, groups_of, generator=g) * 0.05

    w13, w2 = codes(2 * I, H), codes(H, I)
    s13, m13, s2, m2 = groups(2 * I, G), -groups(2 * I, G), groups(H, G // 2), None
    floats = (group_weights(w13, s13, m13, torch.float32), group_weights(w2, s2, m2,
                                                                         torch.float32))
    want = fused_experts(x, ids, weights, *floats, 0)
    got = fused_experts(x, ids, weights, w13, w2, 0, w13_scale=s13, w2_scale=s2,
                        w13_min=m13, w2_min=m2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if tokens == 1:
        plain = one_token_experts(x, ids, weights, w13, w2, 0, w13_scale=s13, w2_scale=s2,
                                  w13_min=m13, w2_min=m2)
        torch.testing.assert_close(plain, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["deepseekv3", "deepseekv2"])
def test_deepseek_latent_projections_stay_in_their_blocks(arch, tmp_path_factory, caplog):
    """A deepseek2 file: the latent attention's projections kept in their Q4_K
    blocks, kv_b_proj put back together from llama.cpp's attn_k_b / attn_v_b (Q8_0,
    expanded: it is read as W_UK and W_UV, logged) equal to the expansion's."""
    from kvserve.engine.models.quantized.layer import QuantizedLinear
    from tests.support.gguf_families import made_family

    caplog.set_level("INFO", logger="kvserve.loader")
    _, _, _, mixed = made_family(arch, tmp_path_factory)
    kept, expanded = load(mixed, "auto"), load(mixed, "none")
    attn, plain = kept.layers[1].self_attn, expanded.layers[1].self_attn
    names = (["q_a_proj", "q_b_proj"] if arch == "deepseekv3" else ["q_proj"]) + \
        ["kv_a_proj_with_mqa", "o_proj"]
    assert all(isinstance(getattr(attn, n), QuantizedLinear) for n in names)
    assert torch.equal(attn.kv_b_proj.weight, plain.kv_b_proj.weight)
    assert "expanded to floats" in caplog.text and "Q8_0" in caplog.text

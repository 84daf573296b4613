"""The routed experts on kvserve's CPU GEMM: kvserve::packed_grouped_linear against a
float64 product per expert (float32, bf16 and int8 panels; experts with no rows, with
more rows than the int8 panels widen in registers, and outputs that end mid-panel),
kvserve::packed_experts against the fused_experts op (gpt-oss's biases and clamped
SwiGLU, another rank's experts left out), FusedExperts.pack, and pack_model packing a
mixture-of-experts model's experts where --cpu-kernels auto leaves its dense layers to
torch (AVX-512, bf16)."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.moe.fused_experts import fused_experts
from kvserve.engine.kernels.moe.packed_experts import (one_token_packed_experts,
                                                       pack_experts, packed_experts,
                                                       unpack_experts)
from kvserve.engine.models.moe import FusedExperts
from kvserve.engine.models.quantized.int8 import quantize_int8
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import load_once, pack_model
from tests.engine.moe.test_fused_experts import case

AVX2 = {"avx2", "fma", "f16c"}
pytestmark = pytest.mark.skipif(not AVX2 <= cpu_flags(),
                                reason="the kernels need AVX2, FMA and F16C")
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_once()


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = quantize_int8(w.reshape(-1, w.shape[-1]), torch.float32)
    return q.view(w.shape), scales.view(w.shape[:2])


@pytest.mark.parametrize("kind", ["float32", "bf16", "int8"])
@pytest.mark.parametrize("counts", [[3, 0, 1, 2], [0, 20, 0, 5], [0, 0, 0, 0]])
def test_the_grouped_gemm_equals_each_experts_product(kind, counts):
    g = torch.Generator().manual_seed(1)
    experts, n, k = 4, 37, 48  # 37 outputs: the last panel holds 5
    w = torch.randn(experts, n, k, generator=g)
    if kind == "bf16":
        w = w.bfloat16().float()
    packed = pack_experts(*int8_rows(w)) if kind == "int8" else pack_experts(w)
    assert packed.panels.dtype == {"float32": torch.float32, "bf16": torch.bfloat16,
                                   "int8": torch.int8}[kind]
    values = unpack_experts(packed, n)
    x = torch.randn(sum(counts), k, generator=g)
    bias = torch.randn(experts, n, generator=g)
    got = torch.ops.kvserve.packed_grouped_linear(x, torch.tensor(counts), packed.panels, n,
                                                  bias, packed.scales)
    expert = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    want = torch.einsum("rk,rnk->rn", x.double(), values[expert].double()) \
        + bias[expert].double()
    assert got.shape == (sum(counts), n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_bad_counts_and_layouts_are_refused():
    w = pack_experts(torch.randn(2, 16, 8)).panels
    x = torch.randn(3, 8)
    grouped = torch.ops.kvserve.packed_grouped_linear
    with pytest.raises(RuntimeError, match="counts sum to 2"):
        grouped(x, torch.tensor([1, 1]), w, 16, None)
    with pytest.raises(RuntimeError, match="counts sum past"):
        grouped(x, torch.tensor([2, 2]), w, 16, None)
    with pytest.raises(RuntimeError, match="int8 panels, and only they, take scales"):
        grouped(x, torch.tensor([1, 2]), w, 16, None, torch.ones(2, 16))
    with pytest.raises(RuntimeError, match="is not experts' panels"):
        grouped(torch.randn(3, 9), torch.tensor([1, 2]), w, 16, None)


@pytest.mark.parametrize("bias,activation,first", [
    (False, ("silu", 0.0, 0.0), 0),
    (True, ("swiglu_oai", 1.5, 1.702), 0),
    (False, ("silu", 0.0, 0.0), 2),  # a second rank's experts 2..5 of 8
])
def test_packed_experts_equal_the_fused_experts_op(bias, activation, first):
    x, ids, weights, w13, w2, b13, b2 = case(tokens=9, experts=8, top_k=3, bias=bias)
    held = slice(first, first + 4) if first else slice(None)
    w13, w2 = w13[held], w2[held]
    b13, b2 = (None, None) if b13 is None else (b13[held], b2[held])
    want = fused_experts(x, ids, weights, w13, w2, first, b13, b2, *activation)
    p13, p2 = pack_experts(w13), pack_experts(w2)
    got = packed_experts(x, ids, weights, p13.panels, p2.panels, w2.shape[2], first, b13, b2,
                         *activation)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def experts_module(bias=False, seed=0) -> FusedExperts:
    torch.manual_seed(seed)
    module = FusedExperts(6, 0, 40, 24, bias=bias)
    for p in module.parameters():
        p.data.normal_(0, 0.2)
    return module


@pytest.mark.parametrize("int8", [False, True])
def test_a_packed_module_computes_what_it_did(int8):
    module = experts_module(bias=True)
    if int8:
        module.quantize_int8()
    x, ids, weights, *_ = case(tokens=11, experts=6, top_k=2)
    want = module(x, ids, weights)
    assert module.pack() and module.packed and not module.pack()  # once
    assert module.w13.dim() == 4 and module.b13.dtype == torch.float32
    torch.testing.assert_close(module(x, ids, weights), want, rtol=1e-5, atol=1e-5)


def test_a_ggufs_grouped_experts_stay_as_they_are():
    module = experts_module()
    q = torch.randint(-8, 8, (6, 48, 40), dtype=torch.int8)
    module.keep_groups("w13", q, torch.rand(6, 48, 2), None)
    assert not module.pack() and not module.packed and module.w13.dtype == torch.int8


def test_auto_packs_the_experts_where_it_leaves_the_dense_layers_to_torch(caplog):
    """AVX-512 and bf16: the dense layers stay on oneDNN, the experts are packed."""
    model = torch.nn.ModuleDict({"experts": experts_module(), "dense": torch.nn.Linear(8, 8)})
    model = model.bfloat16()
    avx512 = AVX2 | {"avx512f", "avx512_bf16"}
    x, ids, weights, *_ = case(tokens=5, experts=6, top_k=2, dtype=torch.bfloat16)
    want = model["experts"](x, ids, weights)
    assert pack_model(model, "auto", CPU, torch.bfloat16, avx512) == 1
    assert model["experts"].packed and model["experts"].w13.dtype == torch.bfloat16
    assert model["dense"].weight is not None
    torch.testing.assert_close(model["experts"](x, ids, weights), want, rtol=0.02, atol=0.02)
    fresh = torch.nn.ModuleDict({"experts": experts_module()})
    assert pack_model(fresh, "torch", CPU, torch.float32, avx512) == 0
    assert not fresh["experts"].packed


@pytest.mark.parametrize("kind", ["float32", "bf16", "int8"])
def test_the_one_token_form_equals_the_op(kind):
    """What the compiled batch-1 graph traces (panels indexed and reduced as plain
    ops), on a second rank's experts with biases, for each kind of panel."""
    x, ids, weights, w13, w2, b13, b2 = case(tokens=1, experts=8, top_k=4, bias=True, seed=3)
    held = slice(4, 8)
    w13, w2, b13, b2 = w13[held], w2[held], b13[held], b2[held]
    if kind == "bf16":
        w13, w2 = w13.bfloat16().float(), w2.bfloat16().float()
    p13, p2 = ((pack_experts(*int8_rows(w13)), pack_experts(*int8_rows(w2))) if kind == "int8"
               else (pack_experts(w13), pack_experts(w2)))
    args = (x, ids, weights, p13.panels, p2.panels, w2.shape[2], 4, b13, b2,
            "swiglu_oai", 1.5, 1.702, p13.scales, p2.scales)
    torch.testing.assert_close(one_token_packed_experts(*args), packed_experts(*args),
                               rtol=1e-5, atol=1e-5)

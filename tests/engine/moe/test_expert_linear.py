"""kvserve::expert_linear, the CPU kernel for decode steps' experts: against a
float64 product per expert (float32, bf16 and int8 weights; experts with no rows and
with more rows than one dot-kernel call takes; inputs past a whole 8), a GGUF's kept
experts (int8 values or 4-bit code pairs, group scales, minimums) against their
expansion, refused bad layouts, and the fused_experts op picking it (few rows per
expert) or torch's grouped GEMM (many) with the same result, gpt-oss's biases and
clamped SwiGLU and another rank's experts included."""
from __future__ import annotations

import pytest
import torch

from kvserve.engine.kernels.cpu.packing import quantized_for_dot
from kvserve.engine.kernels.group_quant import group_weights
from kvserve.engine.kernels.moe import fused_experts as fe
from kvserve.engine.models.quantized.int8 import quantize_int8
from kvserve.engine.platform.device import cpu_flags
from kvserve.engine.weights.cpu_packing import load_once
from tests.engine.moe.test_fused_experts import case, loop

pytestmark = pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(),
                                reason="the kernels need AVX2, FMA and F16C")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    load_once()


def kernel_calls(monkeypatch) -> list:
    """The experts' products the op hands kvserve's kernels, as it runs: one an
    expert_linear call, two a moe_experts call that takes them (both products)."""
    calls = []
    linear, whole = fe._expert_linear, fe._moe_experts

    def counted_whole(*a):
        y = whole(*a)
        calls.extend([1, 1] if y is not None else [])
        return y

    monkeypatch.setattr(fe, "_expert_linear", lambda *a: calls.append(1) or linear(*a))
    monkeypatch.setattr(fe, "_moe_experts", counted_whole)
    return calls


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = quantize_int8(w.reshape(-1, w.shape[-1]), torch.float32)
    return q.view(w.shape), scales.view(w.shape[:2])


@pytest.mark.parametrize("kind", ["float32", "bf16", "int8"])
@pytest.mark.parametrize("counts", [[3, 0, 1, 2], [0, 9, 0, 5], [0, 0, 0, 0]])
@pytest.mark.parametrize("k", [48, 45])  # 45: five inputs past the last whole 8
def test_each_row_is_its_experts_product(kind, counts, k):
    g = torch.Generator().manual_seed(1)
    experts, n = 4, 37
    w = torch.randn(experts, n, k, generator=g)
    scales = None
    if kind == "bf16":
        w = w.bfloat16()
    elif kind == "int8":
        w, scales = int8_rows(w)
    x = torch.randn(sum(counts), k, generator=g)
    got = torch.ops.kvserve.expert_linear(x, torch.tensor(counts), w, scales)
    expert = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    values = w.double() if scales is None else w.double() * scales.double()[..., None]
    want = torch.einsum("rk,rnk->rn", x.double(), values[expert])
    assert got.shape == (sum(counts), n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("nibbles", [False, True], ids=["bytes", "nibbles"])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("group", [16, 32])
def test_group_quantized_rows_equal_their_expansion(nibbles, mins, group):
    g = torch.Generator().manual_seed(2)
    experts, n, k = 3, 21, 64
    counts = [2, 0, 5]
    if nibbles:
        q = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (experts, n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(experts, n, k // group, generator=g) * 0.01
    low = -torch.rand(experts, n, k // group, generator=g) * 0.05 if mins else None
    x = torch.randn(sum(counts), k, generator=g)
    got = torch.ops.kvserve.expert_linear(x, torch.tensor(counts), q, scale, low)
    values = group_weights(q, scale, low, torch.float32).double()
    expert = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    want = torch.einsum("rk,rnk->rn", x.double(), values[expert])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_bad_counts_and_layouts_are_refused():
    w, x = torch.randn(2, 16, 8), torch.randn(3, 8)
    linear = torch.ops.kvserve.expert_linear
    with pytest.raises(RuntimeError, match="counts sum to 2"):
        linear(x, torch.tensor([1, 1]), w)
    with pytest.raises(RuntimeError, match="counts sum past"):
        linear(x, torch.tensor([2, 2]), w)
    with pytest.raises(RuntimeError, match="integer experts, and only they, take scales"):
        linear(x, torch.tensor([1, 2]), w, torch.ones(2, 16))
    q = torch.zeros(2, 16, 4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="4-bit codes need group scales"):
        linear(x, torch.tensor([1, 2]), q, torch.ones(2, 16))
    with pytest.raises(RuntimeError, match="groups of a multiple of 8"):
        linear(x, torch.tensor([1, 2]), q, torch.ones(2, 16, 2))  # groups of 4
    with pytest.raises(RuntimeError, match="is not contiguous"):
        linear(x, torch.tensor([1, 2]), w.transpose(1, 2))


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("bias,activation,first", [
    (False, ("silu", 0.0, 0.0), 0),
    (True, ("swiglu_oai", 1.5, 1.702), 0),
    (False, ("silu", 0.0, 0.0), 2),  # a second rank's experts 2..5 of 8
])
def test_the_op_takes_the_kernel_for_few_rows_and_torch_for_many(int8, bias, activation,
                                                                 first, monkeypatch):
    x, ids, weights, w13, w2, b13, b2 = case(tokens=9, experts=8, top_k=3, bias=bias)
    held = slice(first, first + 4) if first else slice(None)
    w13, w2 = w13[held].contiguous(), w2[held].contiguous()
    b13, b2 = (None, None) if b13 is None else (b13[held], b2[held])
    quant = {}
    if int8:
        (w13, s13), (w2, s2) = int8_rows(w13), int8_rows(w2)
        quant = dict(w13_scale=s13, w2_scale=s2)
    calls = kernel_calls(monkeypatch)
    args = (x, ids, weights, w13, w2, first, b13, b2, *activation)
    few = fe.fused_experts(*args, **quant)
    assert len(calls) == 2  # both products: 27 pairs over 4-8 experts
    monkeypatch.setattr(fe, "EXPERT_LINEAR_MAX_ROWS", 0)
    many = fe.fused_experts(*args, **quant)
    assert len(calls) == 2
    torch.testing.assert_close(few, many, rtol=1e-5, atol=1e-5)
    if not int8:
        want = loop(x, ids, weights, w13, w2, b13, b2, first, activation)
        torch.testing.assert_close(few.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nibbles", [False, True], ids=["bytes", "nibbles"])
def test_the_op_runs_a_ggufs_kept_experts_on_the_kernel(nibbles, monkeypatch):
    """Q4_K-like gate/up (4-bit codes, scales and minimums per 32 inputs) and
    Q6_K-like down (a byte each, a scale per 16) through the op: the kernel's result
    is the per-expert expansion's."""
    g = torch.Generator().manual_seed(4)
    experts, hidden, inter, tokens = 4, 64, 32, 3
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    codes = torch.randint(0, 16, (experts, 2 * inter, hidden), generator=g, dtype=torch.uint8)
    w13 = (codes[..., 0::2] | (codes[..., 1::2] << 4)) if nibbles else codes.to(torch.int8)
    s13 = torch.rand(experts, 2 * inter, hidden // 32, generator=g) * 0.05
    m13 = -torch.rand(experts, 2 * inter, hidden // 32, generator=g) * 0.05
    w2 = torch.randint(-32, 32, (experts, hidden, inter), generator=g, dtype=torch.int8)
    s2 = torch.rand(experts, hidden, inter // 16, generator=g) * 0.01
    calls = kernel_calls(monkeypatch)
    args = (x, ids, weights, w13, w2, 0)
    quant = dict(w13_scale=s13, w2_scale=s2, w13_min=m13)
    got = fe.fused_experts(*args, **quant)
    assert len(calls) == 2
    monkeypatch.setattr(fe, "EXPERT_LINEAR_MAX_ROWS", 0)
    torch.testing.assert_close(got, fe.fused_experts(*args, **quant), rtol=1e-5, atol=1e-5)


def test_int4_experts_run_on_the_kernel_as_their_values():
    """--quantization int4's experts (FusedExperts.quantize_int4: the GGUF kept
    layout, group factors contiguous as the kernel requires) through the kernel equal
    float experts holding the values the codes stand for."""
    from kvserve.engine.models.moe import FusedExperts
    from kvserve.engine.models.quantized.int4 import fake_quantize_int4

    g = torch.Generator().manual_seed(5)
    layer = FusedExperts(4, 0, hidden=64, intermediate=32)
    with torch.no_grad():
        for w in (layer.w13, layer.w2):
            w.copy_(torch.randn(w.shape, generator=g) * 0.2)
    values = [fake_quantize_int4(w.data.reshape(-1, w.shape[-1]), 32).view(w.shape)
              for w in (layer.w13, layer.w2)]
    layer.quantize_int4(32)
    x = torch.randn(3, 64, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(3)])
    weights = torch.rand(3, 2, generator=g)
    got = layer(x, ids, weights)  # few rows an expert: the kernel
    want = fe.fused_experts(x, ids, weights, *values, 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _int8_input_case(seed: int = 6, counts=(4, 0, 1, 7, 2), n: int = 37, k: int = 96):
    g = torch.Generator().manual_seed(seed)
    w, scales = int8_rows(torch.randn(len(counts), n, k, generator=g))
    x = torch.randn(sum(counts), k, generator=g) * 3
    return x, torch.tensor(counts), w, scales


def test_int8_inputs_are_quantized_in_blocks_and_multiplied_as_integers():
    """int8_inputs: every row of x on 255 levels a block of 32 inputs (the int4
    kernel's quantized_for_dot), times the experts' int8 rows exactly: experts
    with no rows, one, and more than a kernel call takes; output rows past a whole 4."""
    x, counts, w, scales = _int8_input_case()
    got = torch.ops.kvserve.expert_linear(x, counts, w, scales, None, True)
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    values = w.double() * scales.double()[..., None]
    want = torch.einsum("rk,rnk->rn", quantized_for_dot(x), values[expert])
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
    exact = torch.einsum("rk,rnk->rn", x.double(), values[expert])
    assert not torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)  # x was quantized
    torch.testing.assert_close(got.double(), exact, rtol=0.05, atol=0.05 * exact.abs().max())


def test_int8_inputs_give_the_same_bits_on_avx2_and_vnni(tmp_path):
    """The two instruction sets' integer sums are exact and laid out alike, so a
    process told KVSERVE_CPU_ISA=avx2 (the AVX2 path, which every machine running the
    kernels has) gets this one's result bit for bit, whichever path this one took."""
    import os
    import subprocess
    import sys

    x, counts, w, scales = _int8_input_case(seed=7, counts=(5, 3, 0, 2, 9))
    got = torch.ops.kvserve.expert_linear(x, counts, w, scales, None, True)
    torch.save((x, counts, w, scales), tmp_path / "case.pt")
    script = ("import sys, torch\n"
              "from kvserve.engine.weights.cpu_packing import load_once\n"
              "load_once()\n"
              "x, c, w, s = torch.load(sys.argv[1])\n"
              "torch.save(torch.ops.kvserve.expert_linear(x, c, w, s, None, True), sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "case.pt"),
                    str(tmp_path / "avx2.pt")], check=True, timeout=300,
                   env={**os.environ, "KVSERVE_CPU_ISA": "avx2"})
    assert torch.equal(torch.load(tmp_path / "avx2.pt"), got)


def test_int8_experts_meet_int8_inputs_up_to_more_rows(monkeypatch):
    """fused_experts' int8_inputs (--quantization int8's experts): the kernel takes
    up to DOTS_MAX_ROWS rows an expert (here 9 tokens x 3 over 4 experts, past
    EXPERT_LINEAR_MAX_ROWS), close to the exact widening's result; with the rows
    over that too, torch's widening alone, exact."""
    x, ids, weights, w13, w2, _, _ = case(tokens=9, experts=4, top_k=3, hidden=64, inter=32)
    (w13, s13), (w2, s2) = int8_rows(w13), int8_rows(w2)
    calls = kernel_calls(monkeypatch)
    args = (x, ids, weights, w13, w2, 0)
    quant = dict(w13_scale=s13, w2_scale=s2)
    monkeypatch.setattr(fe, "EXPERT_LINEAR_MAX_ROWS", 2)
    exact = fe.fused_experts(*args, **quant)
    assert calls == []
    quantized = fe.fused_experts(*args, **quant, int8_inputs=True)
    assert len(calls) == 2
    assert not torch.equal(quantized, exact)
    assert (quantized - exact).norm() / exact.norm() < 0.02  # 255 levels a block of 32
    monkeypatch.setattr(fe, "DOTS_MAX_ROWS", 2)
    assert torch.equal(fe.fused_experts(*args, **quant, int8_inputs=True), exact)
    assert len(calls) == 2


@pytest.mark.parametrize("k", [64, 40])  # 40: eight inputs past the last whole 16
def test_bf16_rows_meet_bf16_experts_as_they_are(k):
    """bf16 rows of x against bf16 experts (a bf16 model's experts: two exact
    products an instruction where the CPU has AVX-512 BF16, else x widened): the
    float64 product of the same values, experts with 0 to 9 rows."""
    g = torch.Generator().manual_seed(8)
    counts = torch.tensor([9, 0, 1, 4, 2])
    w = torch.randn(len(counts), 23, k, generator=g).bfloat16()
    x = torch.randn(int(counts.sum()), k, generator=g).bfloat16()
    got = torch.ops.kvserve.expert_linear(x, counts, w)
    assert got.dtype == torch.float32
    expert = torch.repeat_interleave(torch.arange(len(counts)), counts)
    want = torch.einsum("rk,rnk->rn", x.double(), w.double()[expert])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="or bf16, with bf16 experts"):
        torch.ops.kvserve.expert_linear(x, counts, w.float())


def test_a_bf16_models_experts_take_the_kernel_up_to_more_rows_with_bf16_dots(monkeypatch):
    """bf16 x and experts: where the CPU has AVX-512 BF16, the kernel takes them up
    to DOTS_MAX_ROWS rows an expert (9 tokens x 3 over 4 experts, past
    EXPERT_LINEAR_MAX_ROWS set to 2), as torch's grouped GEMM computes them up to
    bf16's rounding of the gated activations; without it, torch's GEMM."""
    x, ids, weights, w13, w2, _, _ = case(tokens=9, experts=4, top_k=3, hidden=64, inter=32,
                                          dtype=torch.bfloat16)
    calls = kernel_calls(monkeypatch)
    monkeypatch.setattr(fe, "EXPERT_LINEAR_MAX_ROWS", 2)
    got = fe.fused_experts(x, ids, weights, w13, w2, 0)
    assert len(calls) == (2 if torch.ops.kvserve.expert_bf16_dots() else 0)
    monkeypatch.setattr(fe, "DOTS_MAX_ROWS", 2)
    torch_gemms = fe.fused_experts(x, ids, weights, w13, w2, 0)
    assert len(calls) == (2 if torch.ops.kvserve.expert_bf16_dots() else 0)
    want = loop(x, ids, weights, w13, w2, None, None)
    for y in (got, torch_gemms):
        assert (y.double() - want).norm() / want.norm() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_is_the_ops_kernel_path_in_one_call(dtype, monkeypatch):
    """kvserve::moe_experts (routing, gather, both products, SwiGLU and the weighted
    sum in one call) gives what the op's Python steps around expert_linear give, a
    second rank's experts included; past max_rows rows an active expert it takes
    nothing (an empty result) and the op runs torch's GEMMs."""
    x, ids, weights, w13, w2, _, _ = case(tokens=9, experts=8, top_k=3, hidden=64, inter=32,
                                          dtype=dtype)
    w13, w2 = w13[2:6].contiguous(), w2[2:6].contiguous()  # experts 2..5 of 8
    whole = torch.ops.kvserve.moe_experts(x, ids, weights, w13, w2, 2, max_rows=100)
    monkeypatch.setattr(fe, "_moe_experts", lambda *a: None)
    monkeypatch.setattr(fe, "EXPERT_LINEAR_MAX_ROWS", 100)
    monkeypatch.setattr(fe, "DOTS_MAX_ROWS", 100)
    steps = fe.fused_experts(x, ids, weights, w13, w2, 2)
    assert whole.dtype == dtype and whole.shape == x.shape
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else \
        dict(rtol=0.02, atol=0.02)  # the Python steps sum in bf16
    torch.testing.assert_close(whole, steps, **tolerance)
    assert torch.ops.kvserve.moe_experts(x, ids, weights, w13, w2, 2, max_rows=0).dim() == 1
